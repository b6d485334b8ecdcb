"""The weight path, one home: `WeightPublisher` on the trainer side (register subscribers, offer the current
version, publish new ones, know who is behind or lost), `WeightSubscriber` and `WeightReceiver` on the maker
and scorer side (register, receive, verify, stage, swap), the update protocol (`update`), its checks
(`verify`, `provenance`, `base_fingerprint`), encodings (`encoding`, `wire_variants`), sinks (`sink`), the
push queue (`push_queue`) and its Ray wire (`ray_wire`, the package's one Ray module)."""
