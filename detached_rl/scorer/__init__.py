"""The scorer role, Ray-free: the reward, reference and critic roles served to many makers by scorer groups.

For models too big to copy into every maker (the `train_prompts_on_ray` shape), a maker sends each
generated batch to scorer workers and composes its experience from their answers. The plain parts,
testable without Ray: `config` (the roles, `ScorerGroupConfig`), `requests` (`ScoreRequest`,
`ScoreAnswer`, merging requests), `core` (`Scorer`: one role over one model), `batching`
(`RequestBatcher`) and `service` (`ScoringService`, what a maker talks to; `LocalScoring`). The Ray
shell (`ScorerWorker`, scorer groups, `RemoteScoring`) is `detached_rl.actors.scorer`.
"""
