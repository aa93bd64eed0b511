"""Rebuild gpu-b8-limit500-rebuilt.json from the GPU budget-8 rows of docs/simulator.md e (2026-11-25): the best split
per window and overall, snapped to the rate grid; the other splits zeroed (the ratio needs only the best)."""
import json, math
from bench.sim_scenarios import gpu_scenario
from bench.sim_goodput import GRID_STEP
sc = gpu_scenario(limit=500)
base = sc.autoscale_rates[0] * 8 / 4
snap = lambda v: round(base * GRID_STEP ** round(math.log(v / base, GRID_STEP)), 4)
table = {"mooncake": ("5P+3D", 5.86, [6.44, 7.09, 6.44, 4.84], 6.44),
         "burst": ("5P+3D", 4.0, [7.79, 8.57, 3.31, 4.0], 4.4),
         "shift": ("6P+2D", 9.43, [10.4, 10.4, 11.4, 11.4], 8.57)}
cases = []
for wl, (best, g, ws, col) in table.items():
    rows = []
    for p in range(1, 8):
        name = f"{p}P+{8 - p}D"
        rows.append({"config": name, "goodput": snap(g) if name == best else 0.0,
                     "windows": [snap(w) for w in ws] if name == best else [0.0] * 4})
    rows.append({"config": "colocated-8", "goodput": snap(col), "windows": [0.0] * 4})
    cases.append({"scenario": "gpu", "budget": 8, "workload": wl, "configs": rows})
    print(wl, [r for r in rows if r["goodput"]])
json.dump({"cases": cases, "note": "rebuilt from docs/simulator.md e (the 2026-11-25 run): the best fixed split per window and overall, the other splits zeroed"}, open("bench/goodput_fixed/gpu-b8-limit500-rebuilt.json", "w"))
