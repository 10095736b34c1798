"""Two "nodes" on this machine for tests/test_e2e_multinode.py: ``python tests/_two_nodes.py CMD...`` runs CMD twice at
once, as ``srun --nodes=2 --ntasks-per-node=1 CMD`` runs it once on each of two nodes (distributed.launcher), and exits
with the first non-zero status of the two (0 when both succeed)."""

import subprocess
import sys

if __name__ == "__main__":
    nodes = [subprocess.Popen(sys.argv[1:]) for _ in range(2)]
    codes = [node.wait() for node in nodes]
    sys.exit(next((c for c in codes if c), 0))
