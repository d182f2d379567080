"""Scheduler counters: token accounting, cache hits, retractions, step timing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SchedulerStats:
    requests_received: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0  # of admitted requests (first admission)
    cached_tokens: int = 0  # prompt tokens served from the tree at first admission
    prefill_tokens_computed: int = 0  # extend tokens computed, recomputation included
    decode_tokens: int = 0
    # rows through the LM head: one per batch entry per forward (prompt-logprob rows not counted)
    lm_head_rows: int = 0
    generation_tokens: int = 0  # sampled tokens, first tokens included
    forward_steps: int = 0
    decode_steps: int = 0  # forwards that carried at least one decode row
    mixed_steps: int = 0  # forwards that carried decode and prefill rows together
    retractions: int = 0
    priority_preemptions: int = 0  # retractions of lower-priority requests (--priority-preemption)
    evicted_tokens: int = 0
    near_misses: int = 0  # first matches that stopped inside a long cached sequence
    forward_seconds: float = 0.0  # model forward + sampling
    step_seconds: float = 0.0  # whole steps (forward included)
    # Per batch-size bucket (power of two of running requests) of decode-only steps:
    # [steps, seconds outside the forward], to report scheduler overhead at scale.
    overhead_by_batch: dict[str, list[float]] = field(default_factory=dict)
    decode_only_seconds: float = 0.0  # whole decode-only steps: decode speed without prefill
    decode_only_tokens: int = 0  # tokens those steps decoded
    # Per LoRA adapter: [prompt tokens, of them served from the tree] at first admission, and
    # the cached ones by the tier that held them (with --host-cache-size / --disk-cache-dir).
    adapter_tokens: dict[str, list[int]] = field(default_factory=dict)
    adapter_tier_tokens: dict[str, dict[str, int]] = field(default_factory=dict)

    def record_adapter(self, name: str, prompt_tokens: int, cached_tokens: int,
                       by_tier: dict[str, int] | None) -> None:
        entry = self.adapter_tokens.setdefault(name, [0, 0])
        entry[0] += prompt_tokens
        entry[1] += cached_tokens
        tiers = self.adapter_tier_tokens.setdefault(name, {})
        for tier, n in (by_tier or {}).items():
            tiers[tier] = tiers.get(tier, 0) + n

    def record_step(
        self, batch_size: int, decode_only: bool, step_s: float, forward_s: float, tokens: int
    ) -> None:
        """One forward of ``batch_size`` entries that generated ``tokens`` (more than one per
        entry with speculative drafts accepted)."""
        self.forward_steps += 1
        self.step_seconds += step_s
        self.forward_seconds += forward_s
        if decode_only:
            self.decode_only_seconds += step_s
            self.decode_only_tokens += tokens
            bucket = str(1 << max(0, (batch_size - 1).bit_length()))
            entry = self.overhead_by_batch.setdefault(bucket, [0, 0.0])
            entry[0] += 1
            entry[1] += step_s - forward_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cache_hit_rate"] = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        d["adapter_cache_hit_rate"] = {
            name: cached / prompt if prompt else 0.0
            for name, (prompt, cached) in self.adapter_tokens.items()
        }
        d["overhead_ms_per_step"] = (
            1000 * (self.step_seconds - self.forward_seconds) / self.forward_steps
            if self.forward_steps
            else 0.0
        )
        d["overhead_ms_by_batch"] = {
            k: 1000 * v[1] / v[0]
            for k, v in sorted(self.overhead_by_batch.items(), key=lambda kv: int(kv[0]))
        }
        return d
