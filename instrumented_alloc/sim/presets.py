"""The demo engine's model presets: pool shapes, windows and workload parameters of a few typical deployments.

Pool sizes are given in tokens, so a preset keeps its capacity whatever page size it runs at; they are small on
purpose (a laptop runs thousands of steps a second) and sized against the workload so that the pool fills and
the scheduler has to retract: a demo of an idle pool shows nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    page_size: int  # default; --page-size overrides
    full_tokens: int  # capacity of the full-attention pool
    swa_tokens: int | None = None  # capacity of the SWA pool (None: a dense model, one pool)
    window: int | None = None  # sliding window in tokens (SWA presets)
    evict_every: int = 0  # SWA: evict once this many tokens have left the window since the last eviction
    pd_decode: bool = False  # decode side of PD disaggregation: requests arrive prefilled
    need_sort: bool = False  # PD decode side stages frees (SGLang's need_sort)
    rate: float = 0.5  # mean arrivals per step (Poisson)
    prompt_median: int = 256
    prompt_sigma: float = 1.0  # lognormal shape: a heavy right tail of long prompts
    prompt_max: int = 4096
    output_median: int = 128
    output_sigma: float = 0.9
    output_max: int = 1024
    max_running: int = 64  # continuous batching: requests holding KV at once
    chunk_tokens: int = 512  # chunked prefill: tokens prefilled per step, over all requests
    max_waiting: int = 256  # arrivals beyond this queue length are rejected (SGLang's --max-queued-requests)

    @property
    def is_swa(self) -> bool:
        return self.window is not None

    def with_page_size(self, page_size: int | None) -> Preset:
        return self if page_size is None else replace(self, page_size=page_size)

    def with_rate(self, rate: float | None) -> Preset:
        return self if rate is None else replace(self, rate=rate)

    def parameters(self) -> dict:
        """Every parameter, for ``instrumented-alloc presets`` and the recording's metadata."""
        return asdict(self)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="dense",
            description="a dense model: one full-attention pool, chunked prefill, decode, retraction under load",
            page_size=16,
            full_tokens=32768,
            rate=0.3,
        ),
        Preset(
            name="swa-128",
            description="an SWA hybrid with a 128-token window (Gemma-3-like local layers), interval eviction",
            page_size=16,
            full_tokens=32768,
            swa_tokens=12288,
            window=128,
            evict_every=64,
            rate=0.32,
        ),
        Preset(
            name="swa-1024",
            description="an SWA hybrid with a 1024-token window (GPT-OSS-like), long prompts, interval eviction",
            page_size=16,
            full_tokens=65536,
            swa_tokens=32768,
            window=1024,
            evict_every=256,
            rate=0.12,
            prompt_median=1024,
            prompt_max=8192,
            output_median=192,
            output_max=1536,
            chunk_tokens=2048,
        ),
        Preset(
            name="pd-decode",
            description="the decode side of PD disaggregation: prefilled requests preallocated with an SWA tail",
            page_size=16,
            full_tokens=32768,
            swa_tokens=8192,
            window=256,
            evict_every=64,
            pd_decode=True,
            need_sort=True,
            rate=0.15,
            prompt_median=384,
            max_running=64,
        ),
    )
}

PAGE_SIZES = (1, 16, 64)
