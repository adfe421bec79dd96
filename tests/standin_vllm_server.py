"""A stand-in for vLLM's API server in tests of the launcher (pipeline/endpoints/vllm_serve.py): like vLLM, it
forks an engine process that outlives it if nobody stops it, writes "<its pid> <the engine's pid>" to argv[1]
and waits."""
import os
import sys
import time

engine = os.fork()
if engine == 0:  # the "EngineCore": a child of the server, in its process group
    while True:
        time.sleep(1)
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(f"{os.getpid()} {engine}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(1)
