// The index kernel of a ragged (packed, THD) launch. Built to PTX by
// tools/gen_ragged_ptx.sh into csrc/ragged_ptx.inc (committed: building fastattn needs no CUDA
// compiler; the driver compiles the PTX when the kernel is first loaded).
//
// From the cumulative lengths cu_q, cu_kv (n = batch + 1 int32 each), writes the
// arrays cuDNN's ragged graph reads, each `stride` int32 apart in `out`:
// row 0, 1: seq_len_q, seq_len_kv (n - 1 lengths); rows 2-6: the element offsets of
// each sequence in q, k, v, o and the packed stats, cu * mult[row - 2]. A multiplier of
// 0 leaves its row unwritten (a graph without packed stats).
extern "C" __global__ void fastattn_ragged_indices(const int *__restrict__ cu_q, const int *__restrict__ cu_kv, int n,
                                                   int *__restrict__ out, int stride, int m_q, int m_k, int m_v,
                                                   int m_o, int m_stats) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int a = cu_q[i], b = cu_kv[i];
    if (i + 1 < n) {
        out[i]          = cu_q[i + 1] - a;
        out[stride + i] = cu_kv[i + 1] - b;
    }
    out[2 * stride + i] = a * m_q;
    out[3 * stride + i] = b * m_k;
    out[4 * stride + i] = b * m_v;
    out[5 * stride + i] = a * m_o;
    if (m_stats != 0) out[6 * stride + i] = a * m_stats;
}
