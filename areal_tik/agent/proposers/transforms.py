"""Known code transformations of the offline proposer: replacement bodies for ``<tik:...>``
regions of a kernel's source (grouped tile order, unmasked K loop, persistent schedule for the
Triton linear; 16-byte vector loads or the row held in registers for the csrc rms_norm),
with :func:`apply_transform` and the check that a transformation is already applied."""
from __future__ import annotations

from areal_tik.agent.kinds import regions, replace_region

# The csrc rms_norm's element loops over group c (the root's, at 4 spaces: inside a group loop inside a branch);
# the rms transformations keep them for the rows their vector paths do not take.
_RMS_SUMSQ_ELEMENTS = """\
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = c * 8 + e;
      if (idx < n) {
        const float v = to_f(xr[idx]);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
      }
    }"""
_RMS_SCALE_ELEMENTS = """\
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = c * 8 + e;
      if (idx < n) {
        const float h = to_f(from_f<T>(__fmul_rn(to_f(xr[idx]), r)));
        yr[idx] = from_f<T>(__fmul_rn(to_f(w[idx]), h));
      }
    }"""
TRANSFORMS = {
    "grouped-order": ("tile-order", """\
num_pid_in_group = GROUP_M * num_pid_n
group_id = tile_id // num_pid_in_group
first_m = group_id * GROUP_M
group_size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
pid_m = first_m + (tile_id % num_pid_in_group) % group_size_m
pid_n = (tile_id % num_pid_in_group) // group_size_m"""),
    "unmasked-k-loop": ("k-loop", """\
# rows/cols past M/N wrap onto valid rows (computed, never stored): loads need no row mask
offs_am = offs_m % M
offs_wn = offs_n % N
a_ptrs = a_ptr + offs_am[:, None] * s_am + offs_k[None, :] * s_ak
b_ptrs = w_ptr + offs_wn[None, :] * s_wn + offs_k[:, None] * s_wk
for k0 in range(0, K, BLOCK_K):
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
        b = tl.load(b_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
    acc = tl.dot(a, b, acc)
    a_ptrs += BLOCK_K * s_ak
    b_ptrs += BLOCK_K * s_wk"""),
    "persistent": ("schedule", """\
num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
for tile_id in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
    _tile(tile_id, a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
          s_am, s_ak, s_wn, s_wk, s_cm, s_cn,
          HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K)"""),
    # csrc rms_norm (C++ regions of csrc/tik_elementwise.cu): 16-byte loads/stores of 8 elements where the row
    # allows (2-byte types, aligned, a whole group inside n); the same values in the same order as the element
    # loops, so the same sums and bits
    "vector-loads": ("rms-sumsq", """\
float ss = 0.f;
const bool vec = sizeof(T) == 2 && (reinterpret_cast<uintptr_t>(xr) & 15) == 0;
for (int c = lane; c * 8 < n; c += 32) {
  if (vec && c * 8 + 8 <= n) {
    const uint4 u = *reinterpret_cast<const uint4*>(xr + c * 8);
    const T* e8 = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = to_f(e8[e]);
      ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
  } else {
""" + _RMS_SUMSQ_ELEMENTS + """
  }
}"""),
    # csrc rms_norm: a lane's whole share of the row (up to 16 groups of 8 = rows up to 4096 elements) loaded
    # into registers by 16-byte loads issued before the first add, then summed and scaled from registers: one
    # memory latency per row instead of one per loop trip, and x read once. Same values in the same order as
    # the element loops (groups lane, lane + 32, ..., elements ascending), so the same sums and bits; other
    # rows (4-byte types, unaligned, n not a multiple of 8, longer rows) keep the element loops.
    "row-registers": ("rms-sumsq", """\
float ss = 0.f;
constexpr int RG = 16;  // 16-byte groups per lane held in registers
const bool rg = sizeof(T) == 2 && (reinterpret_cast<uintptr_t>(xr) & 15) == 0 && n % 8 == 0 && n <= 256 * RG;
uint4 xg[RG];
if (rg) {
#pragma unroll
  for (int k = 0; k < RG; ++k)
    if ((lane + 32 * k) * 8 < n) xg[k] = __ldg(reinterpret_cast<const uint4*>(xr) + lane + 32 * k);
#pragma unroll
  for (int k = 0; k < RG; ++k) {
    if ((lane + 32 * k) * 8 < n) {
      const T* e8 = reinterpret_cast<const T*>(&xg[k]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float v = to_f(e8[e]);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
      }
    }
  }
} else {
  for (int c = lane; c * 8 < n; c += 32) {
""" + _RMS_SUMSQ_ELEMENTS + """
  }
}"""),
}
# The vector-loads and row-registers texts below share their per-element scale loop on purpose: each is a
# whole replacement of one marked csrc region that the agent applies on its own, so each must stand alone.
_TRANSFORM_EXTRA = {"persistent": ("grid", "return (max(1, min(tiles, _num_sms(device) * cfg.get(\"PROGS_PER_SM\", 1))),)"),
                    "vector-loads": ("rms-scale", """\
const bool vec_o = sizeof(T) == 2 &&
                   ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(yr) | reinterpret_cast<uintptr_t>(w)) &
                    15) == 0;
for (int c = lane; c * 8 < n; c += 32) {
  if (vec_o && c * 8 + 8 <= n) {
    const uint4 ux = *reinterpret_cast<const uint4*>(xr + c * 8);
    const uint4 uw = *reinterpret_cast<const uint4*>(w + c * 8);
    const T* x8 = reinterpret_cast<const T*>(&ux);
    const T* w8 = reinterpret_cast<const T*>(&uw);
    uint4 uy;
    T* y8 = reinterpret_cast<T*>(&uy);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float h = to_f(from_f<T>(__fmul_rn(to_f(x8[e]), r)));
      y8[e] = from_f<T>(__fmul_rn(to_f(w8[e]), h));
    }
    *reinterpret_cast<uint4*>(yr + c * 8) = uy;
  } else {
""" + _RMS_SCALE_ELEMENTS + """
  }
}""")}
_TRANSFORM_EXTRA["row-registers"] = ("rms-scale", """\
if (rg && ((reinterpret_cast<uintptr_t>(yr) | reinterpret_cast<uintptr_t>(w)) & 15) == 0) {
#pragma unroll
  for (int k = 0; k < RG; ++k) {
    const int c = lane + 32 * k;
    if (c * 8 < n) {
      const uint4 uw = __ldg(reinterpret_cast<const uint4*>(w) + c);
      const T* x8 = reinterpret_cast<const T*>(&xg[k]);
      const T* w8 = reinterpret_cast<const T*>(&uw);
      uint4 uy;
      T* y8 = reinterpret_cast<T*>(&uy);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float h = to_f(from_f<T>(__fmul_rn(to_f(x8[e]), r)));
        y8[e] = from_f<T>(__fmul_rn(to_f(w8[e]), h));
      }
      reinterpret_cast<uint4*>(yr)[c] = uy;
    }
  }
} else {
  for (int c = lane; c * 8 < n; c += 32) {
""" + _RMS_SCALE_ELEMENTS + """
  }
}""")
TRANSFORM_PRIORITY = {"unmasked-k-loop": 85.0, "grouped-order": 80.0, "persistent": 55.0, "vector-loads": 70.0,
                       "row-registers": 75.0}


def apply_transform(source: str, name: str) -> str:
    region, body = TRANSFORMS[name]
    out = replace_region(source, region, body)
    if name in _TRANSFORM_EXTRA:
        out = replace_region(out, *_TRANSFORM_EXTRA[name])
    return out


def is_applied(source: str, name: str) -> bool:
    region, body = TRANSFORMS[name]
    r = regions(source).get(region)
    return r is not None and [ln.strip() for ln in r.strip().split("\n")] == [ln.strip() for ln in body.split("\n")]
