"""Plans for a GPU that is not here: `fastattn info --export-gpu FILE` describes this
machine's GPU in a file; `fastattn warm --for FILE` builds that GPU's plans on any machine
with the same fastattn and cuDNN (a deploy's image build, without a GPU) into the cache,
keyed as the GPU's own process keys them, so that a process there loads them and builds
nothing.

cuDNN builds a plan for a GPU described by its DeviceProperties JSON without the device
and without a handle (its "deviceless" build), but it still loads each kernel it generates
through the driver's libcuda. The process that builds for another GPU therefore runs with
fastattn's stand-in libcuda (csrc/nodriver.c) in place of the driver: it answers the few
calls a build makes, loads and runs nothing, and hides a real driver from that process.
Such a process builds and serializes plans only; warm's workers are such processes. Plans
built so load and run bitwise like plans built on the GPU (docs/DECISIONS.md, "Plans built
without the GPU").

The file (JSON): what fastattn's cache key says of a GPU (its name, compute capability
and SM count, as fastattn.device_info reports them there) and cuDNN's DeviceProperties
JSON, with the cuDNN version that wrote it. A properties file is tied to the cuDNN that
reads it (9.28 needs keys 9.19 does not write): export it with the cuDNN the plans are
built with.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from . import files, store
from ._fields import show
from .config import AttentionConfig
from .errors import InvalidArgumentError, LibraryError, NotSupportedError
from .result import ProbeResult

log = logging.getLogger("fastattn")

FORMAT = "fastattn-gpu"
VERSION = 1
MAX_FILE_BYTES = 1 << 20  # a file is ~2 KB; anything near this is not one


@dataclass(frozen=True)
class Gpu:
    """A GPU as a file describes it. name, compute_capability and sm_count are what the
    cache key holds (fastattn.device_info's words); properties is cuDNN's JSON, as the
    cuDNN of version cudnn_version wrote it."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    cudnn_version: int
    properties: bytes

    def key_fields(self) -> dict[str, Any]:
        """What fastattn.plan_cache.PlanCache takes as `gpu`."""
        return {"name": self.name, "compute_capability": self.compute_capability, "sm_count": self.sm_count}

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "name": self.name,
                "compute_capability": list(self.compute_capability), "sm_count": self.sm_count,
                "cudnn_version": self.cudnn_version, "cudnn_properties": self.properties.decode("utf-8")}


def export(device: int | None = None) -> Gpu:
    """This process's GPU `device` (None: the current one), as a file describes it."""
    from . import runtime

    core = runtime._core()
    device = runtime._resolve_device(device)
    info = core.get_device_info(device)
    properties = core.device_properties(device)
    gpu = Gpu(info["name"], tuple(info["compute_capability"]), info["sm_count"], int(core.versions()[0]),
              properties)
    return parse(gpu.to_dict(), "the exported GPU")  # what read() would refuse is never written


def write(path: str, gpu: Gpu) -> None:
    """The file, written whole or not at all (a temporary file renamed into place)."""
    files.write_file(path, (json.dumps(gpu.to_dict(), indent=1, sort_keys=True) + "\n").encode())


def read(path: str) -> Gpu:
    """The GPU the file at `path` describes. Raises InvalidArgumentError naming the file
    and what is wrong with it (not there, too large, not JSON, a field missing or out of
    range, cuDNN's properties inconsistent with the rest)."""
    where = files.shown(path)
    try:
        # (never a FIFO waited on, a device read without end, a folder taken for a file)
        data = files.read_regular(path, MAX_FILE_BYTES)
    except files.FileTooLargeError:
        raise InvalidArgumentError(f"{where}: larger than {MAX_FILE_BYTES} bytes: not a GPU file "
                                   "(`fastattn info --export-gpu FILE` writes one)") from None
    except (OSError, ValueError) as e:  # (ValueError: a NUL in the name)
        raise InvalidArgumentError(f"{where}: {getattr(e, 'strerror', None) or e}") from None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidArgumentError(f"{where}: not JSON: not a GPU file (`fastattn info --export-gpu FILE` "
                                   "writes one)") from None
    return parse(obj, where)


def _int(obj: dict, name: str, lo: int, hi: int, where: str) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidArgumentError(f"{where}: {name}={show(v)}: must be an integer in {lo}..{hi}")
    return v


def parse(obj: Any, where: str = "the GPU file") -> Gpu:
    """A Gpu from the file's JSON object; InvalidArgumentError names the field."""
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"{where}: must be a JSON object, got {show(obj)}")
    if obj.get("format") != FORMAT:
        raise InvalidArgumentError(f"{where}: format={show(obj.get('format'))}: not a GPU file (format "
                                   f"{FORMAT!r}; `fastattn info --export-gpu FILE` writes one)")
    if obj.get("version") != VERSION:
        raise InvalidArgumentError(f"{where}: version={show(obj.get('version'))}: this fastattn reads version "
                                   f"{VERSION}")
    unknown = sorted(set(obj) - {"format", "version", "name", "compute_capability", "sm_count", "cudnn_version",
                                 "cudnn_properties"})
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown field {show(unknown[0])}")
    name = obj.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 256 or not name.isprintable():
        raise InvalidArgumentError(f"{where}: name={show(name)}: must be the GPU's name (1 to 256 printable "
                                   "characters)")
    cc = obj.get("compute_capability")
    if (not isinstance(cc, list) or len(cc) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= 99 for x in cc) or cc[0] < 1):
        raise InvalidArgumentError(f"{where}: compute_capability={show(cc)}: must be [major, minor], e.g. [9, 0]")
    sm_count = _int(obj, "sm_count", 1, 65535, where)
    cudnn_version = _int(obj, "cudnn_version", 1, 10**7, where)
    text = obj.get("cudnn_properties")
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{where}: cudnn_properties={show(text)}: must be cuDNN's DeviceProperties "
                                   "JSON, as a string")
    try:
        props = json.loads(text)
    except (ValueError, RecursionError):
        props = None
    if not isinstance(props, dict):
        raise InvalidArgumentError(f"{where}: cudnn_properties: not a JSON object (cuDNN's DeviceProperties)")
    # cuDNN's description must be of the same GPU as the key's: a file edited by hand, or
    # two files spliced, would otherwise store one GPU's plans under another's key.
    for field, want in (("multiProcessorCount", sm_count), ("deviceVer", cc[0] * 100 + cc[1] * 10)):
        got = props.get(field)
        if got != want or isinstance(got, bool):
            raise InvalidArgumentError(f"{where}: cudnn_properties' {field}={show(got)} does not match "
                                       f"{'sm_count' if field == 'multiProcessorCount' else 'compute_capability'} "
                                       f"({show(want)})")
    return Gpu(name, (cc[0], cc[1]), sm_count, cudnn_version, text.encode("utf-8"))


# -- a process that builds for another GPU -------------------------------------------------

def standin_path() -> str:
    """The stand-in libcuda built with fastattn (csrc/nodriver.c), or LibraryError."""
    import importlib.machinery

    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_nodriver" + suffix)
        if os.path.exists(path):
            return path
    raise LibraryError(f"fastattn's stand-in libcuda (fastattn/_nodriver*.so) is not in {files.shown(here)}: this fastattn "
                       "was built without it (reinstall fastattn)")


def _driver_loaded() -> str | None:
    """The path of a libcuda.so already mapped in this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith("libcuda.so"):
                    return path
    except OSError:
        pass
    return None


_standin: ctypes.CDLL | None = None


def enter_build_process() -> None:
    """Makes this process one that builds for another GPU: loads the stand-in libcuda
    under the driver's name, so that cuDNN (and anything else) finds it instead of the
    driver. Must run before anything loads the driver; raises LibraryError where a driver
    is already loaded (a process that has used a GPU cannot build for another one: warm's
    workers are fresh processes)."""
    global _standin
    if _standin is not None:
        return
    loaded = _driver_loaded()
    if loaded is not None:
        raise LibraryError(f"the driver ({files.shown(loaded)}) is already loaded in this process: plans for another GPU are "
                           "built in a process of their own (fastattn warm --for FILE)")
    # RTLD_GLOBAL, and by its soname (libcuda.so.1): a later dlopen("libcuda.so.1"), or a
    # library that needs it, gets this one.
    _standin = ctypes.CDLL(standin_path(), mode=ctypes.RTLD_GLOBAL)


_warned: set[tuple[int, int]] = set()


def _check_versions(gpu: Gpu, loaded: int) -> None:
    """Warns, once a process, where the file was exported with another cuDNN than the
    one building: cuDNN may not read another release's properties (it then refuses each
    build, saying so), and the plans are keyed by the builder's cuDNN, which the GPU's
    processes must load to find them."""
    if loaded == gpu.cudnn_version or (gpu.cudnn_version, loaded) in _warned:
        return
    _warned.add((gpu.cudnn_version, loaded))
    log.warning("the GPU file was exported with cuDNN %d and the plans are built with cuDNN %d: only processes "
                "that load cuDNN %d find them (export the file with that cuDNN where they differ)",
                gpu.cudnn_version, loaded, loaded)


class _Blobs:
    """What PlanCache.publish serializes: the blobs build_plan_for returned."""

    def __init__(self, built: dict[str, Any]):
        self._built = built

    def serialize(self) -> tuple[bytes, bytes | None]:
        return self._built["forward"], self._built["backward"]


def build(config: AttentionConfig, gpu: Gpu, cache) -> tuple[ProbeResult, str | None]:
    """Builds `config`'s plan for `gpu` in this build process (enter_build_process) and
    stores it in `cache` (a PlanCache for `gpu`) under the key the GPU's own processes
    use, unless the cache holds it already. Returns (the answer, the key of what was
    built and stored now, else None). A refusal is returned, not stored: cuDNN's verdict
    is the GPU's own to give (the stand-in could be the cause), so that GPU probes it
    once there."""
    from . import runtime

    if _standin is None:
        raise LibraryError("plans for another GPU are built in a process that entered "
                           "fastattn.target.enter_build_process() first")
    core = runtime._core()
    _check_versions(gpu, int(core.versions()[0]))
    known = cache.stored_answer(config, 0)
    if known is not None:
        return known, None
    description = cache.describe(config, 0)
    key = store.key_of(description)
    avoided = tuple(description.get("defects", ()))
    t0 = time.perf_counter()
    try:
        built = core.build_plan_for(config, gpu.properties, gpu.compute_capability)
    except NotSupportedError as e:
        return ProbeResult(config, 0, False, str(e), build_seconds=time.perf_counter() - t0, avoided=avoided), None
    seconds = time.perf_counter() - t0
    result = ProbeResult(config, 0, True, "", built["forward_workspace_size"], built["backward_workspace_size"],
                         built["forward_engine"], built["backward_engine"], seconds, "built", avoided)
    if not cache.store.tiers:
        return result, None
    cache.publish(key, description, _Blobs(built), result)
    return result, key
