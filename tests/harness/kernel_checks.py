"""Checks of the Triton kernels (reshard.kernels) against the torch references, byte for byte, on any device:
the GPU tests call them natively, the CPU tests in a subprocess under Triton's interpreter (TRITON_INTERPRET=1,
which must be set before Triton is imported). Each returns a list of failures (empty: all equal)."""
from __future__ import annotations

import torch

from reshard.kernels import KernelTuning

NAN_BYTES = (0x7F, 0xFF)  # float8_e4m3fn NaNs (sign bit aside)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the quantizer takes


def _edge_values(device: torch.device) -> torch.Tensor:
    """bf16 values at the edges: zeros of both signs, denormals, the largest finite, near fp8 rounding ties."""
    vals = [0.0, -0.0, 9.184e-41, -9.184e-41, 1.1755e-38, 3.3895e38, -3.3895e38, 1e-4, -1e-4, 448.0, -448.0,
            464.0, 0.0078125, 0.01171875, 1.0, -1.0, 2.0 ** -9, 3 * 2.0 ** -10]
    return torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16).to(device)


def _inputs(device: torch.device, g: torch.Generator, n: int, k: int, kind: str) -> torch.Tensor:
    x = (torch.randn((n, k), generator=g) * float(torch.empty(()).uniform_(1e-3, 10, generator=g))).to(torch.bfloat16)
    x = x.to(device)
    flat = x.view(-1)
    if kind in ("edges", "nonfinite"):
        e = _edge_values(device)
        idx = torch.randint(0, flat.numel(), (min(flat.numel(), 3 * e.numel()),), generator=g).to(device)
        flat[idx] = e[torch.arange(idx.numel(), device=device) % e.numel()]
    if kind == "zeros":
        x[: max(1, n // 2)] = 0
    if kind == "denormal":
        x.mul_(1e-38)
    if kind == "nonfinite":
        for v in (float("inf"), float("-inf"), float("nan")):
            flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = v
    return x


def _same_fp8(got: torch.Tensor, want: torch.Tensor) -> bool:
    a = got.detach().cpu().contiguous().view(torch.uint8).to(torch.int32)
    b = want.detach().cpu().contiguous().view(torch.uint8).to(torch.int32)
    nan_a = (a == NAN_BYTES[0]) | (a == NAN_BYTES[1])
    nan_b = (b == NAN_BYTES[0]) | (b == NAN_BYTES[1])
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_b], b[~nan_b]))


def _same_f32(got: torch.Tensor, want: torch.Tensor) -> bool:
    a, b = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    nan = torch.isnan(b)
    return bool(torch.equal(torch.isnan(a), nan) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32)))


def check_fp8_table(device: str = "cpu", cases: int = 24, seed: int = 0,
                    blocks: tuple = ((16, 16), (32, 64), (128, 128)), exact_cast: "bool | None" = None,
                    tunings: tuple = (KernelTuning(),)) -> list[str]:
    """The quantizer (kernels.fp8_quantize: all jobs in one launch) against `executors.fp8.quantize_blocks` on
    random shapes (partial edge blocks), strided views (x and q inside larger tensors, s a transposed view) and
    edge values: per block shape and tuning, one table of `cases` jobs of every input dtype and edge-value kind,
    some laid out for wide vectors and some not, quantized in one call, each job's bytes (and what lies around it)
    checked."""
    from reshard.kernels.fp8_quantize import QuantizeTable

    dev = torch.device(device)
    failures = []
    for tuning in tunings:
        g = torch.Generator().manual_seed(seed)
        for block in blocks:
            jobs = [_QuantizerCase(dev, g, case, block, wide=case % 2 == 0) for case in range(cases)]
            QuantizeTable([(c.x, c.q, c.s) for c in jobs], block, tuning, exact_cast=exact_cast).launch()
            if device != "cpu":
                torch.cuda.synchronize(dev)
            failures += [f"tuning {tuning}: {f}" for c in jobs for f in c.failures()]
    return failures


class _QuantizerCase:
    """One random job of the quantizer checks: x (bf16, float16 or float32, an edge-value kind) a strided view
    inside a larger tensor, q a view inside a tensor of 0.5s, s a column-major view beside a row of -1s, and the
    reference's bytes. wide: x's and q's rows start and end on 16-byte boundaries (the kernel's wide vectors)."""

    KINDS = ("random", "edges", "zeros", "denormal", "nonfinite")

    def __init__(self, dev: torch.device, g: torch.Generator, case: int, block: tuple[int, int], wide: bool) -> None:
        from reshard.executors.fp8 import quantize_blocks

        bn, bk = self.block = block
        n = int(torch.randint(1, 3 * bn, (1,), generator=g))
        k = int(torch.randint(1, 3 * bk, (1,), generator=g))
        if wide:
            k = -(-k // 16) * 16
        kind = self.KINDS[case % len(self.KINDS)]
        dtype = INPUT_DTYPES[(case // len(self.KINDS)) % len(INPUT_DTYPES)]  # each kind in each dtype over 15 cases
        pad, col = (16, 0) if wide else (5, 1)
        big = _inputs(dev, g, n + 3, k + pad, kind).to(dtype)  # bf16 values: float16's overflow to inf
        self.x = big[2:2 + n, col:col + k]  # strided: rows k + pad apart
        self.want_q, self.want_s = quantize_blocks(self.x, block)
        self.q_big = torch.full((n + 1, k + pad + 2), 0.5, dtype=torch.float8_e4m3fn, device=dev)
        self.q_col = 0 if wide else 3
        self.q = self.q_big[1:, self.q_col:self.q_col + k]
        nb, kb = -(-n // bn), -(-k // bk)
        self.s_big = torch.full((kb + 1, nb), -1.0, dtype=torch.float32, device=dev)
        self.s = self.s_big[1:].t()  # [nb, kb], column-major
        self.what = f"case {case} ({kind}, {dtype}, {n}x{k}, blocks {bn}x{bk}{', wide' if wide else ''})"

    def failures(self) -> list[str]:
        out = []
        if not _same_fp8(self.q, self.want_q):
            out.append(f"{self.what}: fp8 bytes differ")
        if not _same_f32(self.s, self.want_s):
            out.append(f"{self.what}: scales differ")
        half = torch.tensor(0.5, dtype=torch.float8_e4m3fn).view(torch.uint8).item()
        untouched = self.q_big.view(torch.uint8).clone()
        untouched[1:, self.q_col:self.q_col + self.x.shape[1]] = half
        if not bool((untouched == half).all()):
            out.append(f"{self.what}: wrote outside its view")
        if not bool((self.s_big[0] == -1.0).all()):
            out.append(f"{self.what}: wrote scales outside its view")
        return out


def check_fp8_refits(device: str = "cpu", quantizer: str = "kernel", head_dim: int = 128,
                     layers: int = 2) -> list[str]:
    """Whole quantizing refits with `quantizer` (the kernel) on `device`, each case twice (the second a graph replay
    on GPUs) with the trainer's weights changed in place between: straight into the engine (direct), through the
    wire's shadows, and with receivers quantizing (a trainer TP that cuts the MLP through blocks); the engine's
    tensors must equal the reference checkpoint, byte for byte."""
    import reshard
    from reshard.executors.fp8 import Fp8Executor
    from reshard.executors.reference import allocate, shard
    from reshard.layouts.fp8 import FP8, Fp8Scheme
    from reshard.planner.fp8 import compile_fp8
    from harness.fp8_reference import reference_checkpoint, same_bytes

    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2 * head_dim,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
               vocab_size=300,
               intermediate_size=3 * head_dim, torch_dtype="bfloat16")
    spec = reshard.ModelSpec.from_hf_config(cfg)
    scheme = Fp8Scheme(block=(head_dim, head_dim))
    dev = torch.device(device)
    failures = []
    for tp, direct in ((1, True), (1, False), (2, "auto")):
        src_layout = reshard.MegatronLayout(model=spec, tp=tp)
        fp = compile_fp8(src_layout, reshard.VllmLayout(model=spec), scheme, colocated=True)
        g = torch.Generator().manual_seed(tp)
        w = {t.name: (torch.randn(t.shape, generator=g) * 0.05).to(torch.bfloat16) for t in spec.tensors}
        src = {r: {n: t.to(dev) for n, t in ts.items()} for r, ts in shard(src_layout, w).items()}
        dst = {r: {n: t.to(dev) for n, t in ts.items()} for r, ts in allocate(fp.full_dst, -7.0).items()}
        ex = Fp8Executor(fp, None, 0, src, dst, inner="inprocess", quantizer=quantizer, direct=direct)
        quantized = {t.name for t in fp.full_dst.model.tensors if t.dtype == FP8}
        for step in range(2):
            if step:  # the trainer's step, in place
                w = {n: (t.float() * 0.5 + 0.01).to(torch.bfloat16) for n, t in w.items()}
                for r, ts in shard(src_layout, w).items():
                    for n, t in ts.items():
                        src[r][n].copy_(t)
            ex.refit()
            want = shard(fp.full_dst, reference_checkpoint(w, quantized, scheme.block), fill=-7.0)
            bad = [n for n, t in want[0].items() if not same_bytes(dst[0][n], t)]
            if bad:
                failures.append(f"tp={tp} direct={direct} ({'direct' if ex.direct else 'shadows'}) step {step}: "
                                f"{bad[:4]}")
    return failures


def check_sum64(device: str = "cpu", cases: int = 6, seed: int = 0) -> list[str]:
    """The fused sum64 kernel against the torch reference (`executors.checksum._Sum64`): streams of blocks of
    several dtypes and shapes (1-D runs, 2-D blocks with rows apart), starting at stream positions that cross the
    weights' period (2^23) and far beyond 2^32; the digests must be equal, bit for bit."""
    from reshard.executors.checksum import PERIOD, Streams, _Sum64
    from reshard.kernels.sum64 import Sum64Launches

    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    failures = []
    for case in range(cases):
        blocks = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            dtype = (torch.bfloat16, torch.float32, torch.uint8)[int(torch.randint(0, 3, (1,), generator=g))]
            rows, cols = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 3000, (1,), generator=g))
            big = torch.randint(-2 ** 15, 2 ** 15, (rows + 2, cols + 5), generator=g).to(torch.int16).view(-1)
            big = big.view(torch.uint8)[:((rows + 2) * (cols + 5))].to(dev) if dtype == torch.uint8 else \
                big.view(torch.bfloat16).to(dtype).to(dev) if dtype == torch.float32 else big.view(dtype).to(dev)
            big = big.view(rows + 2, cols + 5)
            blocks.append(big[1:1 + rows, 2:2 + cols] if case % 2 else big[1:1 + rows].reshape(-1))
        start = (0, PERIOD - 777, 3 * PERIOD + 5, (1 << 40) + 12345)[case % 4]
        ref = _Sum64()
        ref.count = start
        for b in blocks:
            ref.update(b.contiguous().view(-1).view(torch.uint8))
        k = Sum64Launches(blocks, start)
        k.launch()
        got = [int(v) & ((1 << 64) - 1) for v in k.sums().tolist()]
        want = [int(v.item()) & ((1 << 64) - 1) for v in ref.sums]
        if got != want or k.count + start != ref.count:
            failures.append(f"case {case} (start {start}, blocks {[tuple(b.shape) for b in blocks]}): sums differ")
        whole = Streams("sum64"), Streams("sum64")
        for b in blocks:
            whole[0].update(0, b)
            whole[1].update(0, b.cpu())  # the reference, on the CPU
        if whole[0].digest(0) != whole[1].digest(0):
            failures.append(f"case {case}: Streams digest on {device} differs from the CPU reference")
    return failures


def check_copy_table(device: str = "cpu", cases: int = 4, seed: int = 0, moe_layers: int = 1,
                     tps: tuple = ((2, 1), (1, 2))) -> list[str]:
    """The table-copy kernel (kernels.copy_table) against torch's copies: pairs of random lengths and byte offsets
    (every word class, 16-byte words down to single bytes, chunks cut mid-copy) in a few buffers, every other byte
    of the buffers unchanged; and the inprocess executor with table=True against the ReferenceExecutor on a
    Qwen3-MoE refit (`tps`: TP2 -> TP1 and TP1 -> TP2), twice, the trainer's weights changed in place between."""
    import reshard
    from reshard.executors import allocate, execute_local, shard
    from reshard.executors import copies
    from reshard.executors.inprocess import InProcessExecutor
    from reshard.kernels.copy_table import CopyTable

    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    failures = []
    for case in range(cases):
        bufs = [torch.randint(0, 256, (int(torch.randint(3000, 9000, (1,), generator=g)),), generator=g,
                              dtype=torch.uint8).to(dev) for _ in range(3)]
        before = [b.clone() for b in bufs]
        pairs, want = [], [b.clone() for b in bufs]
        taken = [[] for _ in bufs]  # destination byte ranges used so far (copies must not overlap each other)
        for _ in range(int(torch.randint(1, 12, (1,), generator=g))):
            align = (16, 8, 4, 2, 1)[int(torch.randint(0, 5, (1,), generator=g))]
            n = align * int(torch.randint(0, 400 // align + 2, (1,), generator=g))
            si, di = (int(torch.randint(0, 3, (1,), generator=g)) for _ in range(2))
            so = align * int(torch.randint(0, (len(bufs[si]) - n) // align, (1,), generator=g))
            do = align * int(torch.randint(0, (len(bufs[di]) - n) // align, (1,), generator=g))
            if any(do < e and s < do + n for s, e in taken[di]):  # sources are read from `before`: any overlap
                continue
            taken[di].append((do, do + n))
            pairs.append((bufs[di][do:do + n], before[si][so:so + n]))
            want[di][do:do + n] = before[si][so:so + n]
        # chunks cut anywhere in a copy, several blocks to a chunk
        tuning = KernelTuning(copy_chunk_bytes=int(torch.randint(16, 300, (1,), generator=g)), copy_block_bytes=64)
        CopyTable(pairs, tuning).launch()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        bad = [i for i in range(3) if not torch.equal(bufs[i].cpu(), want[i].cpu())]
        if bad:
            failures.append(f"case {case}: buffers {bad} differ from torch's copies ({len(pairs)} pairs)")
    spec = reshard.ModelSpec(family="qwen3_moe", hidden_size=128, num_layers=moe_layers, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, intermediate_size=0, moe_intermediate_size=64,
                             num_experts=8, vocab_size=512, qk_norm=True, dtype="bfloat16")
    for tp in tps:
        src_l, dst_l = reshard.MegatronLayout(model=spec, tp=tp[0]), reshard.VllmLayout(model=spec, tp=tp[1])
        plan = reshard.compile(src_l, dst_l)
        w = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in spec.tensors}
        src = {r: {n: t.to(dev) for n, t in ts.items()} for r, ts in shard(src_l, w).items()}
        got = {r: {n: t.to(dev) for n, t in ts.items()} for r, ts in allocate(dst_l, -7.0).items()}
        large, copies.LARGE_BYTES = copies.LARGE_BYTES, 256  # tiny model: its copies "large" enough for the table
        try:
            ex = InProcessExecutor(plan, None, 0, src, got, table=True)
        finally:
            copies.LARGE_BYTES = large
        if ex._table is None:
            failures.append(f"tp={tp}: no copy went through the table")
        for step in range(2):
            if step:
                for ts in src.values():
                    for t in ts.values():
                        t.mul_(0.5).add_(1.0)
            ex.refit()
            want = allocate(dst_l, -7.0)
            execute_local(plan, {r: {n: t.cpu() for n, t in ts.items()} for r, ts in src.items()}, want)
            bad = [(r, n) for r in want for n in want[r] if not torch.equal(got[r][n].cpu(), want[r][n])]
            if bad:
                failures.append(f"bound table tp={tp} step {step}: {bad[:4]}")
    return failures


def _sums_reference(x: torch.Tensor, start: int, period: int) -> list[int]:
    """s1, s2, s3 of executors.checksum for bytes x at stream positions start..., with the weights' period
    `period` (2^23 in the digest; smaller here to cross periods with few bytes), in int64 numpy, mod 2^64."""
    import numpy as np

    b = x.cpu().numpy().astype(np.uint64)
    i = np.arange(start, start + len(b), dtype=np.uint64)
    j = (i % np.uint64(period)).astype(np.int64)
    t = (((j * 1_103_515_245 + 12_345) & ((1 << 31) - 1)) >> 8).astype(np.uint64)
    with np.errstate(over="ignore"):
        return [int(b.sum()), int((b * (i + np.uint64(1))).sum()), int((b * t).sum())]


def check_copy_sum64(device: str = "cpu", cases: int = 6, seed: int = 0, big: bool = False,
                     tps: tuple = ((2, 1), (1, 2))) -> list[str]:
    """The copy-and-checksum kernel (kernels.copy_sum64) against torch's copies and the "sum64" reference: pieces
    of every word class (16-byte aligned, 4-byte, odd) at random places of a few buffers, a stream that starts
    anywhere (across the weights' period 2^23, and past 2^40); with a small period and window as well, so that many
    periods fold onto one window and the 16-bit lanes spill (FLUSH lowered); every other byte unchanged. Then the
    inprocess executor with checksum="sum64" through the kernel against the reference executor's bytes and the
    reference digest of its source blocks, twice (the trainer's weights changed in place between). `big`: also one
    stream of 40 MB (five real periods; GPUs)."""
    import numpy as np

    import reshard
    from reshard.executors import allocate, execute_local, shard
    from reshard.executors.inprocess import InProcessExecutor
    from reshard.executors.checksum import PERIOD, Streams
    from reshard.executors.reference import block
    from reshard.kernels.copy_sum64 import FLUSH, CopySum64

    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    failures = []
    for case in range(cases + (1 if big else 0)):
        large = case == cases
        period, window = ((PERIOD, 16 << 10) if large else (PERIOD, 1024) if case % 3 == 0
                          else (4096, 256) if case % 3 == 1 else (1024, 64))
        size = (48 << 20) if large else 12000
        bufs = [torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).to(dev) for _ in range(2)]
        src, dst = bufs
        before = dst.clone()
        start = 0 if large else (0, PERIOD - 3001, (1 << 40) + 7, 5 * 4096 - 100, 33, 0)[case % 6]
        entries, pieces, pos, free = [], [], start, 0
        for _ in range(int(torch.randint(1, 12, (1,), generator=g))):
            align = (16, 4, 2, 1)[int(torch.randint(0, 4, (1,), generator=g))]
            n = (40 << 20) if large else align * int(torch.randint(0, 2000 // align + 2, (1,), generator=g))
            so = align * int(torch.randint(0, (size - n) // align + 1, (1,), generator=g))
            do = free + align * int(torch.randint(0, 4, (1,), generator=g))
            if do + n > size:
                break
            entries.append((src.data_ptr() + so, dst.data_ptr() + do, n, pos))
            pieces.append((so, do, n))
            pos, free = pos + n, do + n
            if large:
                break
        want = before.clone()
        for so, do, n in pieces:
            want[do:do + n] = src[so:so + n]
        k = CopySum64(np.asarray(entries, dtype=np.int64).reshape(-1, 4), dev, pos - start,
                      KernelTuning(sum64_window_bytes=window, sum64_warps=4), period=period,
                      flush=FLUSH if case % 2 == 0 else 2)
        k.launch()
        got = [int(v) & ((1 << 64) - 1) for v in k.sums().tolist()]
        stream = torch.cat([src[so:so + n] for so, _, n in pieces]) if pieces else src[:0]
        ref = _sums_reference(stream, start, period)
        what = f"case {case} (period {period}, window {window}, start {start}, {len(pieces)} pieces)"
        if got != [v & ((1 << 64) - 1) for v in ref]:
            failures.append(f"{what}: sums differ")
        if not torch.equal(dst.cpu(), want.cpu()):
            failures.append(f"{what}: bytes differ from torch's copies")
        if period == PERIOD and start == 0:
            s = Streams("sum64")
            s.update(0, stream.cpu())
            if k.digest() != s.digest(0):
                failures.append(f"{what}: digest differs from checksum.Streams on the CPU")
    spec = reshard.ModelSpec(family="qwen3", hidden_size=64, num_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=64,
                             qk_norm=True, dtype="bfloat16")
    for tp in tps:
        src_l, dst_l = reshard.MegatronLayout(model=spec, tp=tp[0]), reshard.VllmLayout(model=spec, tp=tp[1])
        plan = reshard.compile(src_l, dst_l)
        w = {t.name: torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in spec.tensors}
        src = {r: {n: t.to(dev) for n, t in ts.items()} for r, ts in shard(src_l, w).items()}
        got = {r: {n: t.to(dev) for n, t in ts.items()} for r, ts in allocate(dst_l, -7.0).items()}
        ex = InProcessExecutor(plan, None, 0, src, got, checksum="sum64", checksum_kernel=True)
        if ex._fused is None:
            failures.append(f"bound tp={tp}: the kernel was not used")
        for step in range(2):
            if step:
                for ts in src.values():
                    for t in ts.values():
                        t.mul_(0.5).add_(1.0)
            digest = ex.refit().digest
            cpu = {r: {n: t.cpu() for n, t in ts.items()} for r, ts in src.items()}
            want = allocate(dst_l, -7.0)
            execute_local(plan, cpu, want)
            bad = [(r, n) for r in want for n in want[r] if not torch.equal(got[r][n].cpu(), want[r][n])]
            if bad:
                failures.append(f"bound checksum tp={tp} step {step}: {bad[:4]}")
            o, s = plan.ops, Streams("sum64")
            flat = {i: cpu[r][n].view(-1) for i, (r, n) in enumerate(zip(plan.src_tensors.ranks,
                                                                         plan.src_tensors.names))}
            for i in np.flatnonzero(np.isin(o["dst_rank"], list(got))).tolist():
                s.update(0, block(flat[int(o["src_tensor"][i])], int(o["src_offset"][i]), int(o["rows"][i]),
                                  int(o["cols"][i]), int(o["src_stride"][i])))
            if digest != s.hexdigest(0):
                failures.append(f"bound checksum tp={tp} step {step}: digest differs from the reference")
    return failures


__all__ = ["check_copy_sum64", "check_copy_table", "check_fp8_refits", "check_fp8_table", "check_sum64"]
