"""Runs SGLang's own descriptor code for bench/control_cost.py, inside SGLang's scratch venv.

Not pdc code and not a copy of SGLang's: it loads the peer harness HARNESS (by default
../shared/peers/sglang-descriptors/peer_sglang_descriptors.py relative to the repository root;
it loads the unmodified SGLang 0.5.23 modules) from the path it is given, sets the request length, and calls the harness's
`bench_send_kvcache` / `bench_send_slice` per case. Usage (argv): HARNESS OUT_JSON CONFIG_JSON.
"""

from __future__ import annotations

import importlib.util
import json
import sys


def main() -> int:
    harness, out_path, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    spec = importlib.util.spec_from_file_location("peer_sglang_descriptors", harness)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    import numpy as np

    cu, mc, sb, base, envs, version, real = m.load_sglang()
    rows = []
    for tokens in cfg["tokens"]:
        m.REQ_TOKENS = tokens  # the harness reads it at call time
        for page in cfg["pages"]:
            for layout in ("contiguous", "fragmented"):
                n_desc = 160 * (tokens // page if layout == "fragmented" else 1)
                heavy = n_desc * 1.5e-6 > cfg["heavy_s"]  # about 1.5 us per descriptor
                tcfg = (dict(min_time=0.0, min_reps=1, max_reps=1, warmup=0) if heavy else
                        dict(min_time=cfg["min_time"], min_reps=3, max_reps=2000, warmup=1))
                r = m.bench_send_kvcache(np, mc, base, envs, page, layout, tcfg)
                r["tokens"] = tokens
                rows.append(r)
                print(f"# sglang done {tokens} {r['case']}", file=sys.stderr, flush=True)
    if cfg.get("slice"):
        m.REQ_TOKENS = 8192
        tcfg = dict(min_time=cfg["min_time"], min_reps=3, max_reps=50, warmup=1)
        for r in m.bench_send_slice(np, mc, base, envs, 16, "fragmented", tcfg, 1):
            r["tokens"] = 8192
            rows.append(r)
    with open(out_path, "w") as f:
        json.dump({"sglang_version": version, "numpy": np.__version__, "real_modules": real,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
