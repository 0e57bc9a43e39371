import sys, numpy as np
from llmz.state import load_checkpoint, full_ranges
from llmz.layout import Layout, init_parameters
ck = load_checkpoint(sys.argv[1])
lay = Layout(ck.config, 1)
p = ck.assemble("params", full_ranges(lay))
init = init_parameters(lay, 1337)
m = ck.assemble("m", full_ranges(lay))
print("ckpt step", ck.step, "params - init:", float(np.abs(p - init).max()), "m absmax", float(np.abs(m).max()), "data", ck.meta["data"])
