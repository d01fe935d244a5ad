"""Products of few rows: the C++ few-rows kernel (`kernels/src/cpu_linear.py`) against oneDNN's product on weights packed
once (as `prepack_weights` keeps them), on SmolLM2-135M's layer shapes, for each of `--rows` (issue 25): where
`cpu_linear.FEW_ROWS` comes from.

`--layers` layers of random weights of SmolLM2's shapes (q, k, v, o, gate, up, down: 30 layers hold 424 MB, so every
product reads its weight from memory, as in a decode step), all of them once per pass; the best of `--repeats` passes
per side, the two sides interleaved.

    python eval/few_rows.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache.kernels import cpu_attention, cpu_linear  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [out, in]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 24, 32, 48, 64, 96])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="eval/results/few_rows")
    args = parser.parse_args(argv)
    if not (cpu_attention.available() and torch.backends.mkldnn.is_available()):
        raise SystemExit("few_rows.py needs the C++ CPU kernels built and torch's oneDNN")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(out, width) * width**-0.5 for out, width in SHAPES] for _ in range(args.layers)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(weight, 2048) for weight in layer] for layer in weights]
    sides = {
        "few_rows": lambda x, weight, _packed: cpu_linear.linear_rows_cpu(x, weight),
        "onednn": lambda x, _weight, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    rows_out = []
    for rows in args.rows:
        inputs = {width: torch.randn(rows, width) for width in {width for _out, width in SHAPES}}
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.repeats):
            for name, product in sides.items():
                start = time.perf_counter()
                for layer, layer_packed in zip(weights, packed):
                    for weight, packed_weight in zip(layer, layer_packed):
                        product(inputs[weight.shape[1]], weight, packed_weight)
                best[name] = min(best[name], time.perf_counter() - start)
        flops = 2 * rows * sum(out * width for out, width in SHAPES) * args.layers
        row = {"rows": rows, **{f"{name}_ms": seconds * 1e3 for name, seconds in best.items()},
               "few_rows_gflops": flops / best["few_rows"] / 1e9, "onednn_gflops": flops / best["onednn"] / 1e9,
               "onednn_over_few_rows": best["onednn"] / best["few_rows"]}  # fmt: skip
        print({key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()}, flush=True)
        rows_out.append(row)
    result = {"layers": args.layers, "threads": args.threads, "few_rows_bound": cpu_linear.FEW_ROWS, "rows": rows_out}
    common.write_json(f"{args.out}.json", result)
    return result


if __name__ == "__main__":
    main()
