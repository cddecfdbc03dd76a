"""dcgm: read GPU framebuffer usage from NVIDIA's DCGM exporter.

Names: ``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE`` (MiB), one series per GPU
(labels ``gpu``, ``UUID``, ``modelName``, and ``Hostname`` or, in newer exporters,
``hostname``), or per MIG instance (``GPU_I_ID``, ``GPU_I_PROFILE``). Per GPU, usage = used / (used + free); the node's usage is the fullest
GPU's, since one full GPU stalls the whole tensor-parallel group. DCGM knows nothing of
requests or KV tokens: queues and capacity stay None.

Note: vLLM reserves ``gpu_memory_utilization`` of the framebuffer at start, so this
ratio sits near that fraction whatever the load; it is a guard against memory taken
outside the engine, not a KV gauge.
"""

from __future__ import annotations

from extproc.signals.exposition import Index, Series
from extproc.signals.sample import Findings, NodeSample, ScrapeError

FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"

WANTED = frozenset({FB_USED, FB_FREE})


def _gpu_key(s: Series) -> str:
    """_gpu_key names one GPU, or one MIG instance of it: with MIG, instances share their
    GPU's ``UUID`` and differ by ``GPU_I_ID`` (keyed by the UUID alone, the last instance
    listed would hide the others, and a full one could read as idle)."""
    gpu = s.labels.get("UUID") or s.labels.get("gpu", "")
    instance = s.labels.get("GPU_I_ID")
    return gpu if not instance else f"{gpu}/{instance}"


def extract(index: Index, model_name: str | None) -> NodeSample:
    """extract reads one DCGM exposition into a ``NodeSample`` (usage of the fullest GPU)."""
    del model_name  # DCGM labels carry the GPU model, not the served model
    f = Findings()
    used = {_gpu_key(s): s.value for s in index.get(FB_USED, [])}
    free = {_gpu_key(s): s.value for s in index.get(FB_FREE, [])}
    gpus = sorted(used.keys() & free.keys())
    if not gpus:
        f.missing(f"{FB_USED} and {FB_FREE} for a same GPU")
        return f.sample(kv_usage=None)
    ratios: list[float] = []
    for gpu in gpus:
        u, fr = used[gpu], free[gpu]
        if not (u >= 0.0 and fr >= 0.0) or u + fr <= 0.0 or u + fr == float("inf"):
            f.add(ScrapeError.BAD_VALUE, f"GPU {gpu[:64]!r}: {FB_USED}={u}, {FB_FREE}={fr}")
            return f.sample(kv_usage=None)  # an unreadable GPU may be the full one
        ratio = f.ratio(u / (u + fr), "GPU framebuffer usage")
        if ratio is None:
            return f.sample(kv_usage=None)
        ratios.append(ratio)
    return f.sample(kv_usage=max(ratios))
