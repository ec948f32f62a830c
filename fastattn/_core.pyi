# Type stub of the extension fastattn._core (fastattn/_core.pyx): what type checkers
# and editors see of plans. Keep in step with _core.pyx; tests/runtime/test_runtime.py
# checks that every public name here exists in the built module and the reverse.
from typing import Any, Protocol, SupportsIndex

from fastattn._arrays import DeviceTensor
from fastattn.config import AttentionConfig
from fastattn.defects import Decision, Defect

class _DLPack(Protocol):
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

class _CudaArrayInterface(Protocol):
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

class _CudaStream(Protocol):
    def __cuda_stream__(self) -> tuple[int, int]: ...

# A tensor: a device address as an int (the unchecked, zero-overhead path) or an
# integer-like object (numpy integers); or a device array (DLPack, CUDA Array
# Interface, plan.allocate's DeviceTensor), checked against the config. 0: not given.
Address = int | SupportsIndex | _DLPack | _CudaArrayInterface | DeviceTensor
# A cudaStream_t as an int, or a stream object (cuda.core Stream, __cuda_stream__).
StreamLike = int | SupportsIndex | _CudaStream

# The tensors' names in slot order (fastattn/include/fastattn_abi.h's slot table).
SLOT_NAMES: tuple[str, ...]

class Plan:
    """A built (or loaded) cuDNN attention plan for one AttentionConfig on one device."""

    @property
    def config(self) -> AttentionConfig: ...
    @property
    def device(self) -> int: ...
    @property
    def forward_workspace_size(self) -> int: ...
    @property
    def backward_workspace_size(self) -> int: ...
    @property
    def workspace_size(self) -> int: ...
    @property
    def forward_engine(self) -> str | None: ...
    @property
    def backward_engine(self) -> str | None: ...
    @property
    def forward_ms(self) -> float: ...
    @property
    def backward_ms(self) -> float: ...
    @property
    def training(self) -> bool: ...
    @property
    def defects(self) -> Decision: ...
    def forward(
        self,
        q: Address,
        k: Address,
        v: Address,
        o: Address,
        stats: Address = 0,
        workspace: Address = 0,
        stream: StreamLike = 0,
        seq_len_q: Address = 0,
        seq_len_kv: Address = 0,
        *,
        ragged_q: Address = 0,
        ragged_k: Address = 0,
        ragged_v: Address = 0,
        ragged_o: Address = 0,
        ragged_stats: Address = 0,
        bias: Address = 0,
        seed: Address = 0,
        offset: Address = 0,
        sink: Address = 0,
        page_table_k: Address = 0,
        page_table_v: Address = 0,
        descale_q: Address = 0,
        descale_k: Address = 0,
        descale_v: Address = 0,
        descale_s: Address = 0,
        scale_s: Address = 0,
        scale_o: Address = 0,
        amax_s: Address = 0,
        amax_o: Address = 0,
        cu_seqlens_q: Address = 0,
        cu_seqlens_kv: Address = 0,
    ) -> None: ...
    def backward(
        self,
        q: Address,
        k: Address,
        v: Address,
        o: Address,
        d_o: Address,
        stats: Address,
        d_q: Address,
        d_k: Address,
        d_v: Address,
        workspace: Address = 0,
        stream: StreamLike = 0,
        seq_len_q: Address = 0,
        seq_len_kv: Address = 0,
        *,
        ragged_q: Address = 0,
        ragged_k: Address = 0,
        ragged_v: Address = 0,
        ragged_o: Address = 0,
        ragged_stats: Address = 0,
        bias: Address = 0,
        d_bias: Address = 0,
        seed: Address = 0,
        offset: Address = 0,
        sink: Address = 0,
        d_sink: Address = 0,
        descale_q: Address = 0,
        descale_k: Address = 0,
        descale_v: Address = 0,
        descale_o: Address = 0,
        descale_d_o: Address = 0,
        descale_s: Address = 0,
        descale_d_p: Address = 0,
        scale_s: Address = 0,
        scale_d_q: Address = 0,
        scale_d_k: Address = 0,
        scale_d_v: Address = 0,
        scale_d_p: Address = 0,
        amax_d_q: Address = 0,
        amax_d_k: Address = 0,
        amax_d_v: Address = 0,
        amax_d_p: Address = 0,
        cu_seqlens_q: Address = 0,
        cu_seqlens_kv: Address = 0,
    ) -> None: ...
    def allocate(self, name: str, stream: StreamLike | None = None) -> DeviceTensor: ...
    def serialize(self) -> tuple[bytes, bytes | None]: ...

def init_cudnn(path: str) -> int: ...
def versions() -> tuple[int, int, int]: ...
def status_codes() -> dict[str, int]: ...
def policy() -> str: ...
def get_device_count() -> int: ...
def get_current_device() -> int: ...
def get_device_info(device: int) -> dict[str, Any]: ...
def build_plan(cfg: AttentionConfig, device: int, registry: tuple[Defect, ...] | None = None) -> Plan: ...
def load_plan(
    cfg: AttentionConfig,
    device: int,
    forward_blob: bytes,
    backward_blob: bytes | None = None,
    forward_engine: str = "",
    backward_engine: str = "",
    registry: tuple[Defect, ...] | None = None,
) -> Plan: ...

# Benchmark hooks (benchmarks/ and tests only; csrc/bench.h).
def bench_execute(
    plan: Plan,
    direction: str,
    mode: str,
    iters: int,
    workspace: int = 0,
    stream: int = 0,
    *,
    layers: int = 1,
    layer_bytes: int = 0,
    **tensors: int,
) -> float: ...
def bench_direct_launch(plan: Plan, direction: str) -> bool: ...
def bench_pack_counts() -> tuple[int, int, int]: ...
def bench_raw_execute(
    plan: Plan, direction: str, ptrs: Any, workspace: int = 0, stream: int = 0, iters: int = 1000
) -> float: ...

# The C ABI for native code outside _core (fastattn/include/fastattn_abi.h).
def abi_capsule() -> Any:
    """The fastattn_abi table as a PyCapsule named "fastattn._core.abi"."""
def abi_graphs(plan: Plan) -> tuple[int, int]:
    """(forward, backward) graph addresses of plan for fastattn_abi.execute (0: none)."""
