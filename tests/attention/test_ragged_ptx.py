"""The ragged index kernel ships as PTX generated from its CUDA source
(tools/gen_ragged_ptx.sh): the committed PTX must be the source's."""

import hashlib
import re

from helpers.paths import ROOT


def test_the_committed_ptx_was_generated_from_the_committed_source():
    source = (ROOT / "csrc" / "ragged_indices.cu").read_bytes()
    inc = (ROOT / "csrc" / "ragged_ptx.h").read_text()
    recorded = re.search(r"^// source sha256: ([0-9a-f]{64})$", inc, re.M)
    assert recorded, "csrc/ragged_ptx.h names no source digest: run tools/gen_ragged_ptx.sh"
    assert recorded.group(1) == hashlib.sha256(source).hexdigest(), (
        "csrc/ragged_indices.cu changed since csrc/ragged_ptx.h was generated: run tools/gen_ragged_ptx.sh")


def test_the_ptx_defines_the_kernel_the_core_loads_at_an_isa_every_supported_driver_jits():
    inc = (ROOT / "csrc" / "ragged_ptx.h").read_text()
    ptx = inc.split('R"ptx(', 1)[1].rsplit(')ptx"', 1)[0]
    assert ".visible .entry fastattn_ragged_indices(" in ptx
    assert re.search(r"^\.version 7\.0$", ptx, re.M)  # CUDA 11.0's ISA: CUDA 12 drivers and newer JIT it
    assert re.search(r"^\.target sm_75$", ptx, re.M)
    # The core's launch passes ten arguments: cu_q, cu_kv, n, out, stride and five multipliers.
    assert len(re.findall(r"\.param \.(u64|u32) fastattn_ragged_indices_param_\d+", ptx)) == 10
    assert 'cudaLibraryGetKernel' in (ROOT / "csrc" / "ragged.cpp").read_text()
    assert '"fastattn_ragged_indices"' in (ROOT / "csrc" / "ragged.cpp").read_text()
