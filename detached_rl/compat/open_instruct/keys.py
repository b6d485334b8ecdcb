"""The keys a learner rank's `step` returns for the driver: token counts, model size, peak FLOP/s, lengths."""

#: Keys a rank's `step` returns for the driver only (dropped from the logged metrics).
TOKEN_COUNT, SEQUENCE_TOKENS, NUM_PARAMS, PEAK_FLOPS = ("_token_count", "_sequence_tokens", "_num_params",
                                                       "_peak_flops")
#: Array metrics of a rank's step: prompt lengths (one per prompt) and response lengths (one per sample).
PROMPT_LENGTHS, RESPONSE_LENGTHS = "batch/prompt_lengths", "batch/response_lengths"
