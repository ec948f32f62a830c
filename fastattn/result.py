"""ProbeResult: what cuDNN answered for one config on one device, wherever the answer
came from (a build, the persistent cache, this process's memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import AttentionConfig
from .verdict import Verdict

__all__ = ["ProbeResult", "result_from_plan"]


@dataclass(frozen=True)
class ProbeResult:
    """What cuDNN answered for one config on one device.

    supported: whether cuDNN built every graph the config needs (forward; backward too
      when training).
    reason: cuDNN's own message when not supported ("forward: ..." or "backward: ..."),
      else "".
    forward_workspace_size, backward_workspace_size: bytes (0 when not supported).
    forward_engine, backward_engine: cuDNN's plan names ("" when absent).
    build_seconds: wall time this call spent building or loading (0.0 from memory).
    source: "built" (cuDNN built it now), "disk" (loaded from a cache directory),
      "remote" (loaded from the Redis tier) or "memory" (this process already had it).
    avoided: the known cuDNN defects (fastattn.defects) the plan's graphs avoid, as
      "name:remedy" (the cache key's own words); empty for most configs.
    verdict: what verifying the plan showed (fastattn.verdict.Verdict: verify=True,
      `--verify`, or stored with the entry by an earlier verification), else None. A
      failed one comes with supported=False and its evidence as the reason.
    """

    config: AttentionConfig
    device: int
    supported: bool
    reason: str = ""
    forward_workspace_size: int = 0
    backward_workspace_size: int = 0
    forward_engine: str = ""
    backward_engine: str = ""
    build_seconds: float = 0.0
    source: str = "built"
    avoided: tuple[str, ...] = ()
    verdict: Verdict | None = None

    def __bool__(self) -> bool:
        return self.supported

    @property
    def cached(self) -> bool:
        """The answer came without a cuDNN build (from memory or disk)."""
        return self.source != "built"

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "device": self.device,
            "supported": self.supported,
            "reason": self.reason,
            "forward_workspace_size": self.forward_workspace_size,
            "backward_workspace_size": self.backward_workspace_size,
            "forward_engine": self.forward_engine,
            "backward_engine": self.backward_engine,
            "build_seconds": self.build_seconds,
            "source": self.source,
            "avoided": list(self.avoided),
            "verdict": self.verdict.to_dict() if self.verdict is not None else None,
        }


def result_from_plan(config: AttentionConfig, device: int, p: Any, seconds: float, source: str) -> ProbeResult:
    """The answer a plan object (_core.Plan) gives: supported, with its sizes and engines."""
    decision = getattr(p, "defects", None)
    avoided = tuple(decision.key_part()) if decision is not None else ()
    return ProbeResult(config, device, True, "", p.forward_workspace_size, p.backward_workspace_size,
                       p.forward_engine or "", p.backward_engine or "", seconds, source, avoided)
