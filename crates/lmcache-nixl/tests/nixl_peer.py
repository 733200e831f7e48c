"""A NIXL peer on LMCache's own calls (nixl_agent, get_reg_descs, get_xfer_descs,
get_serialized_descs, deserialize_descs, prep_xfer_dlist, make_prepped_xfer), driven over
stdin/stdout by tests/wheel.rs: it serves pages for the Rust agent to read, then reads the
Rust agent's pages through the descriptor list the Rust side pickled."""
import json
import sys
import time

import numpy as np

for modname in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
    try:
        mod = __import__(modname, fromlist=["nixl_agent"])
        break
    except ImportError:
        mod = None
if mod is None:
    sys.exit("no NIXL wheel in this Python")

PAGE = 4096
PAGES = 8
agent = mod.nixl_agent("py-peer", mod.nixl_agent_config(backends=["UCX"]))
buf = np.array([(i * 7 + 3) % 251 for i in range(PAGE * PAGES)], dtype=np.uint8)
addr = buf.ctypes.data
agent.register_memory(agent.get_reg_descs([(addr, buf.nbytes, 0, "")], "cpu"))
descs = agent.get_xfer_descs([(addr + i * PAGE, PAGE, 0) for i in range(PAGES)], "cpu")
local = agent.prep_xfer_dlist("", descs, "cpu")
print(json.dumps({"md": agent.get_agent_metadata().hex(),
                  "descs": agent.get_serialized_descs(descs).hex()}), flush=True)

# The Rust side's metadata and pickled page list.
theirs = json.loads(sys.stdin.readline())
name = agent.add_remote_agent(bytes.fromhex(theirs["md"]))
remote = agent.prep_xfer_dlist(name, agent.deserialize_descs(bytes.fromhex(theirs["descs"])))
# Read their pages 2 and 0 into our pages 6 and 7.
xfer = agent.make_prepped_xfer("READ", local, [6, 7], remote, [2, 0])
agent.transfer(xfer)
deadline = time.time() + 20
while (state := agent.check_xfer_state(xfer)) == "PROC" and time.time() < deadline:
    time.sleep(0.001)
agent.release_xfer_handle(xfer)
got = bytes(buf[6 * PAGE:8 * PAGE])
print(json.dumps({"state": state, "got": got.hex()}), flush=True)
sys.stdin.readline()  # stay up until the Rust side is done reading ours
