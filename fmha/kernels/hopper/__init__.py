"""The Hopper (SM90) kernel. Importing this package makes the CuTe DSL target sm_90a unless
CUTE_DSL_ARCH says otherwise: that is what lets it compile on a machine without a GPU."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
