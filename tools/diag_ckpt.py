import sys

import numpy as np

from llmz.layout import Layout, init_parameters
from llmz.state import full_ranges, load_checkpoint

ck = load_checkpoint(sys.argv[1])
lay = Layout(ck.config, 1)
p = ck.assemble("params", full_ranges(lay))
init = init_parameters(lay, 1337)
m = ck.assemble("m", full_ranges(lay))
print("ckpt step", ck.step, "params - init:", float(np.abs(p - init).max()), "m absmax", float(np.abs(m).max()), "data", ck.meta["data"])
