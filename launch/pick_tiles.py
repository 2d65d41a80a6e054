"""Pick the faster GEMM+RS large-tile config from two A/B record files (used by launch/bench-gemm-rs.sh)."""
import json
import sys

best = min(sys.argv[1:], key=lambda arg: sum(json.loads(l)["ours_us"] for l in open(arg.split("=")[1])))
print(best.split("=")[0])
