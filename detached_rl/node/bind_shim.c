/* Bind to the node's address where a program asks for all interfaces.
 *
 * Loaded with LD_PRELOAD into `ray start` and, through the environment they inherit, into every process of a
 * Ray node (GCS, raylet, agents, workers). Ray 2.60 binds its gRPC servers to 0.0.0.0 / [::] on any node whose
 * address is not 127.0.0.1, and no option changes that. This wraps libc's bind(): a wildcard IPv4 address
 * becomes DETACHED_RL_BIND_ADDRESS; a wildcard dual-stack IPv6 address becomes that address IPv4-mapped
 * (::ffff:a.b.c.d); an IPv6-only wildcard becomes ::1 (the node has no IPv6 address of its own here).
 * Only binds to the node's own ports are changed: DETACHED_RL_BIND_PORTS lists them ("6379-6385,10001,
 * 11000-11099"; unset: every port). A program's other wildcard sockets (an ephemeral port, a torch TCPStore
 * that its clients reach on 127.0.0.1) keep their meaning. Explicit addresses, other families (Unix
 * sockets) and processes without DETACHED_RL_BIND_ADDRESS are left alone.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_function)(int, const struct sockaddr *, socklen_t);
static bind_function real_bind;
static struct in_addr node_address;
static int have_node_address;

#define MAX_RANGES 64
static unsigned long range_low[MAX_RANGES], range_high[MAX_RANGES];
static int range_count = -1; /* -1: every port */

static void load_ports(const char *text) {
    if (text == NULL) return;
    range_count = 0;
    while (*text != '\0' && range_count < MAX_RANGES) {
        char *end;
        unsigned long low = strtoul(text, &end, 10), high = low;
        if (end == text) break;
        if (*end == '-') {
            text = end + 1;
            high = strtoul(text, &end, 10);
        }
        if (low > 0 && high >= low && high <= 65535) {
            range_low[range_count] = low;
            range_high[range_count++] = high;
        }
        text = end;
        if (*text == ',') text++;
        else if (*text != '\0') break;
    }
}

static int node_port(in_port_t port) {
    if (range_count < 0) return 1;
    unsigned long value = ntohs(port);
    for (int i = 0; i < range_count; i++)
        if (range_low[i] <= value && value <= range_high[i]) return 1;
    return 0;
}

__attribute__((constructor)) static void load(void) {
    real_bind = (bind_function)dlsym(RTLD_NEXT, "bind");
    const char *text = getenv("DETACHED_RL_BIND_ADDRESS");
    have_node_address = text != NULL && inet_pton(AF_INET, text, &node_address) == 1;
    load_ports(getenv("DETACHED_RL_BIND_PORTS"));
}

static int bind_ipv4(int fd, const struct sockaddr *address, socklen_t length) {
    struct sockaddr_in copy;
    memcpy(&copy, address, sizeof copy);
    if (copy.sin_addr.s_addr != htonl(INADDR_ANY) || !node_port(copy.sin_port))
        return real_bind(fd, address, length);
    copy.sin_addr = node_address;
    return real_bind(fd, (const struct sockaddr *)&copy, sizeof copy);
}

static int bind_ipv6(int fd, const struct sockaddr *address, socklen_t length) {
    struct sockaddr_in6 copy;
    memcpy(&copy, address, sizeof copy);
    if (!IN6_IS_ADDR_UNSPECIFIED(&copy.sin6_addr) || !node_port(copy.sin6_port))
        return real_bind(fd, address, length);
    int only_ipv6 = 0;
    socklen_t size = sizeof only_ipv6;
    if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &only_ipv6, &size) != 0) only_ipv6 = 0;
    if (only_ipv6) {
        copy.sin6_addr = in6addr_loopback;
    } else {
        memset(&copy.sin6_addr, 0, sizeof copy.sin6_addr);
        copy.sin6_addr.s6_addr[10] = 0xff;
        copy.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&copy.sin6_addr.s6_addr[12], &node_address, 4);
    }
    return real_bind(fd, (const struct sockaddr *)&copy, sizeof copy);
}

int bind(int fd, const struct sockaddr *address, socklen_t length) {
    if (real_bind == NULL) load();
    if (!have_node_address || address == NULL) return real_bind(fd, address, length);
    if (address->sa_family == AF_INET && length >= (socklen_t)sizeof(struct sockaddr_in))
        return bind_ipv4(fd, address, length);
    if (address->sa_family == AF_INET6 && length >= (socklen_t)sizeof(struct sockaddr_in6))
        return bind_ipv6(fd, address, length);
    return real_bind(fd, address, length);
}
