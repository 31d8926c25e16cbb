import sys
base, out, steps = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
s=open(base).read()
def rep(old,new):
    global s
    assert s.count(old)==1, old[:60]; s=s.replace(old,new)
if "first" in steps:
    rep('''__device__ __forceinline__ void mbar_init(''','''__device__ __forceinline__ void wgmma_m64n64k16_ss_first(float (&d)[32], uint32_t a_lo, uint32_t b_lo) {
  asm volatile(
      "{\\n.reg .b64 da, db;\\nmov.b64 da, {%32, %34};\\nmov.b64 db, {%33, %34};\\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "da, db, 0, 1, 1, 0, 0;\\n}\\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]),
        "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]),
        "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]),
        "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
      : "r"(a_lo), "r"(b_lo), "r"(WG_DESC_HI));
}

__device__ __forceinline__ void mbar_init(''')
    rep('''      wgmma_m64n64k16_ss(s, q_lo + off, k_lo + off, kc > 0);''','''      if (kc == 0)
        wgmma_m64n64k16_ss_first(s, q_lo + off, k_lo + off);
      else
        wgmma_m64n64k16_ss(s, q_lo + off, k_lo + off, 1);''')
if "pb" in steps or "pbmov" in steps or "pbz" in steps:
    if "pbz" in steps:
        rep('''    for (int st = 0; st < WG_STAGES; ++st) mbar_init(bars + 8 * st, 1);
''', '''    for (int st = 0; st < WG_STAGES; ++st) mbar_init(bars + 8 * st, 1);
    asm volatile("st.shared.u32 [%0], %1;\\n" ::"r"(bars + 56), "r"(0u) : "memory");  // zword
''')
    rep('''  auto scale_pack_close = [&](int j) {  // acc *= alpha_j; P_j -> bf16 A fragments; chunk end?
#pragma unroll
    for (int x = 0; x < DT * 4; ++x) acc[x] = __fmul_rn(acc[x], alpha[(x >> 1) & 1]);
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      pa[kc][0] = pack_bf16(s[(2 * kc) * 4 + 0], s[(2 * kc) * 4 + 1]);
      pa[kc][1] = pack_bf16(s[(2 * kc) * 4 + 2], s[(2 * kc) * 4 + 3]);
      pa[kc][2] = pack_bf16(s[(2 * kc + 1) * 4 + 0], s[(2 * kc + 1) * 4 + 1]);
      pa[kc][3] = pack_bf16(s[(2 * kc + 1) * 4 + 2], s[(2 * kc + 1) * 4 + 3]);
    }
''','''  uint32_t pb[BN / 16][4];
  auto pack = [&]() {
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      pb[kc][0] = pack_bf16(s[(2 * kc) * 4 + 0], s[(2 * kc) * 4 + 1]);
      pb[kc][1] = pack_bf16(s[(2 * kc) * 4 + 2], s[(2 * kc) * 4 + 3]);
      pb[kc][2] = pack_bf16(s[(2 * kc + 1) * 4 + 0], s[(2 * kc + 1) * 4 + 1]);
      pb[kc][3] = pack_bf16(s[(2 * kc + 1) * 4 + 2], s[(2 * kc + 1) * 4 + 3]);
    }
  };
  auto scale_pack_close = [&](int j) {  // acc *= alpha_j; P_j -> bf16 A fragments; chunk end?
    uint32_t zword;  // 0, read from shared memory after the wait: pa is defined outside the wgmma stage
    asm volatile("ld.shared.u32 %0, [%1];\\n" : "=r"(zword) : "r"(bars + 56) : "memory");
#pragma unroll
    for (int x = 0; x < DT * 4; ++x) acc[x] = __fmul_rn(acc[x], alpha[(x >> 1) & 1]);
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc)
#pragma unroll
      for (int e = 0; e < 4; ++e) ''' + ('asm volatile("mov.b32 %0, %1;\\n" : "=r"(pa[kc][e]) : "r"(pb[kc][e]));' if "pbmov" in steps else ('pa[kc][e] = pb[kc][e] ^ zword;' if "pbz" in steps else 'pa[kc][e] = pb[kc][e];')) + '''
''')
    rep('''      softmax(j);
      wg_wait0();''','''      softmax(j);
      ''' + ('pack();\n      wg_wait0();' if "early" in steps else 'wg_wait0();\n      pack();'))
    rep('''    softmax(0);
    scale_pack_close(0);''','''    softmax(0);
    pack();
    scale_pack_close(0);''')
if "br" in steps:
    rep('''      wg_wait0();
      reg_fence(acc);
      if constexpr''','''      if (p.batch < 0) __nanosleep(1);  // never taken: a basic-block boundary, the wait stays after the softmax
      wg_wait0();
      reg_fence(acc);
      if constexpr''')
if "sw" in steps:
    rep('''      softmax(j);''','''      softmax(j);
      __syncwarp();''')
open(out,'w').write(s)
