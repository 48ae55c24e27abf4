"""The Hopper (SM90) kernel. Importing this package makes the CuTe DSL target sm_90a unless
CUTE_DSL_ARCH says otherwise: that is what lets it compile on a machine without a GPU."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# What the scheduling heuristics assume of the GPU: H100 and H200 (SXM) both have 132 SMs and
# 50 MB of L2.
NUM_SMS = 132
L2_BYTES = 50 * 2**20
