"""Known cuDNN defects: graphs cuDNN builds that compute the wrong answer, and their remedies;
known gaps: graphs a cuDNN release refuses that another builds; and known variances:
what a release does that is no wrong answer but that a user counting on bits should know.

A graph cuDNN accepts can still be wrong. Each entry here names the cuDNN versions (the
library loaded at run time, not the headers) and compute capabilities it was seen on, a
predicate over the AttentionConfig, the public reports, and its remedy: a graph variant
that is correct, or a refusal with the reason where none is.

`decide(config, cudnn_version, capability)` is the one decision. Its callers:
fastattn._core.build_plan / load_plan (the graph builder: which graph to build), and
PlanCache.describe (the cache key: a remedied plan has another key than a plain one), so
the probe, the plan, the key and `fastattn warm` agree. A config no entry matches gets an
empty decision, and then exactly the graph and the key it had before this module existed.

A version range is [first, fixed): `fixed` stays None (open-ended) until a release that
fixes the defect has been measured with fastattn's tests (tests/attention/
test_numerics_gpu.py); a release note alone does not move it.

A gap (`GAPS`) changes no graph and no key: the refusal stays cuDNN's, since the probe
builds the very graph that would run, and `refusal_notes` adds to cuDNN's reason what is
known about it (the versions seen refusing and building that graph, and what to do).
A variance (`VARIANCES`) changes nothing either: `variance_notes` says it for the loaded
cuDNN and GPU (`fastattn info`), with what fastattn does about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import _fields
from .config import FIELDS, FP8_DTYPES, AttentionConfig
from .errors import InvalidArgumentError

__all__ = ["Defect", "Decision", "DEFECTS", "FULL_LENGTHS", "GAPS", "Gap", "REFUSE", "VARIANCES", "Variance",
           "decide", "explain", "refusal_notes", "variance_notes", "version_text"]

# Remedies. FULL_LENGTHS: the affected direction's graph is built with a padding mask, and
# the plan gives it each sequence's full lengths itself (csrc: Config.full_lengths), so
# callers pass exactly the tensors they pass today. REFUSE: the plan is refused with the
# defect's summary as the reason.
FULL_LENGTHS = "full_lengths"
REFUSE = "refuse"
_REMEDIES = (FULL_LENGTHS, REFUSE)
_DIRECTIONS = ("forward", "backward")


def version_text(v: int) -> str:
    """cuDNN's version number (major * 10000 + minor * 100 + patch, as cudnnGetVersion
    gives it for 9.x) as "9.19.0"."""
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


@dataclass(frozen=True)
class Defect:
    """One known defect. `name` is stable: it enters cache keys, so renaming one moves
    every affected key (do that only with the remedy itself changing)."""

    name: str
    summary: str  # what goes wrong, in one sentence: the probe's note and a refusal's reason
    first: int  # the first cuDNN version affected (cudnnGetVersion's number)
    fixed: int | None  # the first measured fixed version; None: still open
    capabilities: frozenset[tuple[int, int]]
    direction: str  # the graph that is wrong: "forward" or "backward"
    predicate: Callable[[AttentionConfig], bool]
    reports: tuple[str, ...]
    remedy: str  # FULL_LENGTHS or REFUSE

    def __post_init__(self) -> None:
        if self.remedy not in _REMEDIES:
            raise InvalidArgumentError(f"Defect {self.name!r}: remedy={self.remedy!r} is not one of {_REMEDIES}")
        if self.direction not in _DIRECTIONS:
            raise InvalidArgumentError(f"Defect {self.name!r}: direction={self.direction!r} is not one of "
                                       f"{_DIRECTIONS}")
        if self.fixed is not None and self.fixed <= self.first:
            raise InvalidArgumentError(f"Defect {self.name!r}: fixed={self.fixed} is not after first={self.first}")
        if not self.reports:
            raise InvalidArgumentError(f"Defect {self.name!r}: names no public report")

    def affects_version(self, cudnn_version: int) -> bool:
        return self.first <= cudnn_version and (self.fixed is None or cudnn_version < self.fixed)

    def matches(self, config: AttentionConfig, cudnn_version: int, capability: tuple[int, int]) -> bool:
        if not self.affects_version(cudnn_version) or tuple(capability) not in self.capabilities:
            return False
        if self.direction == "backward" and not config.training:
            return False  # no backward graph is built
        return bool(self.predicate(config))

    def how(self) -> str:
        """How the remedy avoids it, for the probe's output."""
        if self.remedy == FULL_LENGTHS:
            return f"{self.direction} built with a padding mask over the full sequence lengths"
        return "refused"

    def versions(self) -> str:
        fixed = "open" if self.fixed is None else f"fixed in {version_text(self.fixed)}"
        return f"cuDNN >= {version_text(self.first)} ({fixed})"


def _lengths_given(c: AttentionConfig) -> bool:
    """The config already masks with per-sequence lengths (ragged and paged need
    padding): its graph has the remedy's padding mask, over the caller's lengths."""
    return c.padding


def _sixteen_bit(c: AttentionConfig) -> bool:
    # The FP8 graphs run other kernels; no report covers them.
    return c.dtype not in FP8_DTYPES


def _kv_tail(c: AttentionConfig) -> bool:
    return (_sixteen_bit(c) and not _lengths_given(c) and c.seqlen_kv % 128 == 64
            and (c.mask == "none" or c.bias != "none"))


def _single_query(c: AttentionConfig) -> bool:
    # Reported at s_kv = 128 (97 is finite) for non-causal attention. The multiples of 128
    # and the masks are covered too: the remedy costs one query row little, and a wrong
    # gradient costs a training run.
    return _sixteen_bit(c) and not _lengths_given(c) and c.seqlen_q == 1 and c.seqlen_kv % 128 == 0


def _one_row(c: AttentionConfig) -> bool:
    # Seen crashing for every s_kv (64 to 1024), head dim (64, 128) and 16-bit dtype tried on
    # cuDNN 9.28.1; one more batch, head or query row builds.
    return _sixteen_bit(c) and c.batch == 1 and c.heads_q == 1 and c.seqlen_q == 1


_SM90 = frozenset({(9, 0)})
_GRID = 65535  # CUDA's largest grid dimension in y and z


def _shape_override(c: AttentionConfig) -> bool:
    return c.shape_override


def _override_not_causal(c: AttentionConfig) -> bool:
    # What ran right with the declared strides: the same shapes with a plain top-left causal
    # mask and no other option. Anything else (no mask, a window, a score modifier, ...) is
    # unmeasured or measured wrong.
    if not c.shape_override:
        return False
    shapes = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim_qk", "head_dim_v", "dtype",
              "layout")
    return c != AttentionConfig(**{n: getattr(c, n) for n in shapes}, mask="causal", shape_override=True)


def _batch_past_the_grid(c: AttentionConfig) -> bool:
    return c.batch > _GRID


def _heads_past_the_grid(c: AttentionConfig) -> bool:
    return c.heads_q > _GRID

# The reports do not say in which release either defect began; every cuDNN 9 is assumed
# affected (the remedy is exact, so a false match costs time, never correctness).
DEFECTS: tuple[Defect, ...] = (
    Defect(
        name="sm90-bwd-kv-tail",
        summary=("cuDNN's SM90 backward masks the last 128-key tile at 64-key granularity, so for s_kv = 64 "
                 "(mod 128) without a causal mask (or with a bias) zero-filled keys enter exp(0 - LSE): rows whose "
                 "log-sum-exp is below -88.7 get NaN d_q"),
        first=90000,
        # Measured on an H100: the plain backward's d_q is NaN on the adversarial rows with
        # 9.19.0 and 9.24.0 and finite with 9.28.1 (tests/attention/test_numerics_gpu.py).
        # The report says 9.26 fixed it; 9.26 to 9.28.0 are unmeasured and keep the remedy.
        fixed=92801,
        capabilities=_SM90,
        direction="backward",
        predicate=_kv_tail,
        reports=("https://github.com/NVIDIA/cudnn-frontend/pull/628",
                 "https://github.com/pytorch/pytorch/issues/196678",
                 "https://github.com/huggingface/trl/issues/7181"),
        remedy=FULL_LENGTHS,
    ),
    Defect(
        name="sm90-bwd-single-query",
        summary=("cuDNN's SM90 backward with one query and s_kv a multiple of 128 gives NaN d_k and d_v when the "
                 "row's log-sum-exp is strongly negative"),
        first=90000,
        fixed=None,
        capabilities=_SM90,
        direction="backward",
        predicate=_single_query,
        reports=("https://github.com/NVIDIA/cudnn-frontend/issues/1072",),
        remedy=FULL_LENGTHS,
    ),
    Defect(
        name="sm90-bwd-one-row-crash",
        summary=("cuDNN's SM90 backward plan for batch = heads = s_q = 1 crashes the process while it is created "
                 "(a segmentation fault, no status), so it is never built"),
        # Reported on 9.26.0; built fine on 9.19.0 and 9.24.0, crashed on 9.28.1 (H100).
        first=92600,
        fixed=None,
        capabilities=_SM90,
        direction="backward",
        predicate=_one_row,
        reports=("https://github.com/NVIDIA/cudnn-frontend/issues/1071",),
        remedy=REFUSE,
    ),
    # Measured by tools/override_probe on an H100 (docs/BENCHMARKS.md, "Shape classes"): with
    # the tensors in the declared storage (buffers laid out for the declared length, the dims
    # alone overridden; what execute_at now requires), cuDNN 9.28.1's plan matched the exact
    # plans bitwise with a causal mask at 64 to 3968 of 4096; without a mask at 2048 too, but
    # not at 1000 (off the 64-row tile). Before 9.28.1 only calls at other strides were run.
    Defect(
        name="sm90-sdpa-shape-override",
        summary=("cuDNN's SM90 attention plans built with the shape override (cuDNN 9.21 and newer) were not seen "
                 "right before 9.28.1: with cuDNN 9.24 on an H100 they gave wrong outputs or an illegal memory "
                 "access (at calls' own strides; the declared ones, which fastattn requires, were first run on "
                 "9.28.1); use exact plans or ragged shape classes"),
        first=92100,
        fixed=92801,
        capabilities=_SM90,
        direction="forward",
        predicate=_shape_override,
        reports=("https://github.com/NVIDIA/cudnn-frontend/pull/1148",),
        remedy=REFUSE,
    ),
    Defect(
        name="sdpa-shape-override-unmasked",
        summary=("cuDNN's attention plan built with the shape override gives wrong outputs without a causal mask "
                 "at lengths off its 64-row tile (measured with cuDNN 9.28.1 on an H100 at length 1000 of 4096; "
                 "cudnn-frontend#1148 saw the same with 9.26 on SM89); only a plain top-left causal mask was seen "
                 "right, so other masks and options are refused too; use exact plans or ragged shape classes"),
        first=92100,
        fixed=None,
        capabilities=_SM90 | frozenset({(8, 9)}),
        direction="forward",
        predicate=_override_not_causal,
        reports=("https://github.com/NVIDIA/cudnn-frontend/pull/1148",),
        remedy=REFUSE,
    ),
    # Plans cuDNN builds whose kernels cannot launch (benchmarks/probe_launch_limits.py, the
    # same on 9.19 and 9.24): the probe must not call them supported.
    Defect(
        name="sm90-bwd-batch-past-grid",
        summary=("cuDNN builds the SM90 backward of a batch above 65535 but its kernel cannot launch (a grid "
                 "dimension past CUDA's 65535: CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER at execute); the forward "
                 "runs, so split the batch into parts of at most 65535 sequences for training; PyTorch's "
                 "test_mem_eff_attention_fail_with_batch_size_geq_65536 found it"),
        first=90000,
        fixed=None,
        capabilities=_SM90,
        direction="backward",
        predicate=_batch_past_the_grid,
        reports=("https://github.com/pytorch/pytorch/blob/main/test/test_transformers.py",),
        remedy=REFUSE,
    ),
    Defect(
        name="sm90-fwd-heads-past-grid",
        summary=("cuDNN builds the SM90 forward of more than 65535 query heads but its kernel cannot launch (a grid "
                 "dimension past CUDA's 65535: CUDA's 'invalid argument' at launch); split the heads into parts of "
                 "at most 65535"),
        first=90000,
        fixed=None,
        capabilities=_SM90,
        direction="forward",
        predicate=_heads_past_the_grid,
        reports=("https://docs.nvidia.com/cuda/cuda-c-programming-guide/#features-and-technical-specifications",),
        remedy=REFUSE,
    ),
)


@dataclass(frozen=True)
class Decision:
    """What the registry decides for one config, cuDNN and GPU.

    avoided: the matching defects, in registry order (empty: the plain graphs).
    full_lengths: the directions ("forward", "backward") whose graphs take the
      FULL_LENGTHS remedy.
    refusal: the reason the plan is refused, or "" (a REFUSE remedy matched).
    """

    avoided: tuple[Defect, ...] = ()
    full_lengths: frozenset[str] = frozenset()
    refusal: str = ""

    def __bool__(self) -> bool:
        return bool(self.avoided)

    def key_part(self) -> list[str]:
        """What the cache key's description holds: the defects and their remedies, by
        name (a list, empty for an unaffected config, which then adds nothing)."""
        return [f"{d.name}:{d.remedy}" for d in self.avoided]

    def notes(self) -> list[str]:
        """One line per avoided defect: which, how, and where it is reported."""
        return [f"avoided cuDNN defect {d.name} ({d.versions()}): {d.how()}; {d.summary}; "
                f"see {', '.join(d.reports)}" for d in self.avoided]

    def to_dict(self) -> list[dict[str, Any]]:
        return [{"defect": d.name, "remedy": d.remedy, "how": d.how(), "summary": d.summary,
                 "reports": list(d.reports), "cudnn": d.versions()} for d in self.avoided]


_NONE = Decision()


def decide(config: AttentionConfig, cudnn_version: int, capability: tuple[int, int] | list[int],
           defects: tuple[Defect, ...] = DEFECTS) -> Decision:
    """The registry's decision for `config` with the cuDNN of version `cudnn_version`
    (loaded at run time) on a GPU of compute capability `capability` ((major, minor)).
    Deterministic: a function of its arguments alone."""
    if not isinstance(config, AttentionConfig):
        raise InvalidArgumentError(f"config must be an AttentionConfig, not {type(config).__name__}")
    if isinstance(cudnn_version, bool) or not isinstance(cudnn_version, int) or cudnn_version < 0:
        raise InvalidArgumentError(f"cudnn_version={cudnn_version!r} must be a non-negative int "
                                   "(cudnnGetVersion's number, 91900 for 9.19.0)")
    cap = tuple(capability)
    if len(cap) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in cap):
        raise InvalidArgumentError(f"capability={capability!r} must be (major, minor) ints")
    hits = tuple(d for d in defects if d.matches(config, cudnn_version, cap))
    if not hits:
        return _NONE
    refusals = [d for d in hits if d.remedy == REFUSE]
    refusal = "; ".join(f"{d.direction}: known cuDNN defect {d.name} ({d.versions()}): {d.summary} "
                        f"(see {', '.join(d.reports)})" for d in refusals)
    full = frozenset(d.direction for d in hits if d.remedy == FULL_LENGTHS)
    return Decision(hits, full, refusal)


def explain(avoided: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """What ProbeResult.avoided's "name:remedy" entries mean, from this registry (an entry
    written by another fastattn may name a defect this one does not know: its name and
    remedy alone, then)."""
    known = {d.name: d for d in DEFECTS}
    out = []
    for part in avoided:
        name, _, remedy = str(part).partition(":")
        d = known.get(name)
        if d is None or d.remedy != remedy:
            out.append({"defect": name, "remedy": remedy})
        else:
            out.append(Decision((d,)).to_dict()[0])
    return out


@dataclass(frozen=True)
class Gap:
    """A graph some cuDNN releases refuse though another builds it. Nothing is decided
    from it: cuDNN's refusal is the verdict, and the gap's note goes beside its reason.
    `seen_refusing` and `seen_building` are the releases fastattn's own runs saw (never
    guessed: a release between them is unknown, and the note says only what was seen)."""

    name: str
    summary: str  # which graphs are refused, in one sentence
    seen_refusing: tuple[int, ...]
    seen_building: tuple[int, ...]
    capabilities: frozenset[tuple[int, int]]
    predicate: Callable[[AttentionConfig, bool], bool]  # (config, whether its graphs take per-sequence lengths)
    advice: str  # what a user can do instead
    evidence: str  # where the runs are recorded

    def __post_init__(self) -> None:
        if not self.seen_refusing:
            raise InvalidArgumentError(f"Gap {self.name!r}: seen_refusing is empty (a gap is what a run saw)")

    def matches(self, config: AttentionConfig, cudnn_version: int, capability: tuple[int, int],
                lengths_in_graph: bool) -> bool:
        return (_seen_range(self.seen_refusing, self.seen_building, cudnn_version)
                and tuple(capability) in self.capabilities and bool(self.predicate(config, lengths_in_graph)))

    def note(self) -> str:
        return (f"known cuDNN gap {self.name}: {self.summary} ({_seen_text('seen refusing', self.seen_refusing)}; "
                f"{_seen_text('seen building', self.seen_building)}; {self.evidence}); {self.advice}")


def _seen_range(seen: tuple[int, ...], seen_not: tuple[int, ...], cudnn_version: int) -> bool:
    """From the oldest release seen doing it on, up to the next one seen not doing it (if any):
    what the runs saw, and the releases between them taken as the older one."""
    first = min(seen)
    newer_not = [v for v in seen_not if v > first]
    return first <= cudnn_version and (not newer_not or cudnn_version < min(newer_not))


def _seen_text(label: str, versions: tuple[int, ...]) -> str:
    return f"{label}: cuDNN {', '.join(version_text(v) for v in sorted(versions)) or 'none'}"


def _modifier_with_lengths(c: AttentionConfig, lengths_in_graph: bool) -> bool:
    # Beside a score modifier the graph applies its masks inside the modifier (csrc/graphs.h,
    # as cudnn-frontend requires): the lengths' comparisons are what cuDNN finds no kernel for.
    return lengths_in_graph and bool(_fields.score_modifiers(FIELDS, c))


GAPS: tuple[Gap, ...] = (
    Gap(
        name="sm90-score-modifier-with-lengths",
        summary=("on SM90, no graph with a score modifier (logit soft-capping) whose masks take per-sequence "
                 "lengths (padding, packed sequences, a paged cache, or a defect's full-length remedy) is built, "
                 "whatever the mask (\"KERNEL_CFG knob must be set\"); without per-sequence lengths it is built "
                 "with every mask"),
        seen_refusing=(92400, 92801),
        seen_building=(91900,),
        capabilities=_SM90,
        predicate=_modifier_with_lengths,
        advice=("run soft-capping with per-sequence lengths on cuDNN 9.19, or give the batch without them (equal "
                "lengths, no padding)"),
        evidence="docs/VERIFICATION.md",
    ),
)


def refusal_notes(config: AttentionConfig, cudnn_version: int, capability: tuple[int, int] | list[int],
                  gaps: tuple[Gap, ...] = GAPS) -> list[str]:
    """The notes of the known gaps that explain cuDNN's refusal of `config`'s graphs with
    this cuDNN on this GPU (empty where none does). A graph takes per-sequence lengths
    where the config has padding or a defect's FULL_LENGTHS remedy applies."""
    cap = tuple(capability)
    lengths = config.padding or bool(decide(config, cudnn_version, cap).full_lengths)
    return [g.note() for g in gaps if g.matches(config, cudnn_version, cap, lengths)]


@dataclass(frozen=True)
class Variance:
    """What some cuDNN releases do that is no wrong answer, yet matters to a user who counts
    on bits: said by `fastattn info` for the loaded cuDNN and GPU, with what fastattn does
    about it. As a gap's, `seen` and `seen_not` are the releases fastattn's own runs saw."""

    name: str
    summary: str  # what the release does, in one sentence
    seen: tuple[int, ...]
    seen_not: tuple[int, ...]
    capabilities: frozenset[tuple[int, int]]
    advice: str  # what fastattn does, and what a user can do
    evidence: str  # where the runs are recorded

    def __post_init__(self) -> None:
        if not self.seen:
            raise InvalidArgumentError(f"Variance {self.name!r}: seen is empty (a variance is what a run saw)")

    def matches(self, cudnn_version: int, capability: tuple[int, int] | list[int]) -> bool:
        return _seen_range(self.seen, self.seen_not, cudnn_version) and tuple(capability) in self.capabilities

    def note(self) -> str:
        return (f"known cuDNN variance {self.name}: {self.summary} ({_seen_text('seen', self.seen)}; "
                f"{_seen_text('seen not', self.seen_not)}; {self.evidence}); {self.advice}")


VARIANCES: tuple[Variance, ...] = (
    Variance(
        name="sm90-rebuild-bits",
        summary=("two builds of one graph, with the same engine and knobs, now and then give outputs that differ in "
                 "bits, both right"),
        seen=(92400,),
        seen_not=(91900, 92801),
        capabilities=_SM90,
        advice=("a plan is one build, and every process that loads it from the cache runs that build: for the "
                "same bits in every process, build once (`fastattn warm`) and share the cache directory or the "
                "Redis tier"),
        evidence='docs/VERIFICATION.md, "Builds of one graph"',
    ),
)


def variance_notes(cudnn_version: int, capability: tuple[int, int] | list[int],
                   variances: tuple[Variance, ...] = VARIANCES) -> list[str]:
    """The notes of the known variances of this cuDNN on this GPU (empty where none)."""
    return [v.note() for v in variances if v.matches(cudnn_version, capability)]
