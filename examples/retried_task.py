import json
import time
import taskpoint

def do_one_step(step: int) -> float:          # your work: here 5 ms and a made-up loss
    time.sleep(0.005)
    return 1.0 / (step + 1)

@taskpoint.task(retries=3)                   # the run: $TASKPOINT_RUN_NAME when set, else a new one
def train(steps: int) -> float:
    cp = taskpoint.ctx().checkpoint          # saves to this attempt, loads from the last one that saved
    prev = cp.load_sync()                    # None on the first attempt of the run
    state = json.loads(prev.read_bytes()) if prev else {"step": 0, "loss": None}
    print(f"resuming at {state['step']}", flush=True)
    for step in range(state["step"], steps):
        state = {"step": step + 1, "loss": do_one_step(step)}
        if state["step"] % 100 == 0:
            cp.save_sync(json.dumps(state).encode())
            print(f"saved {state['step']}", flush=True)
    return state["loss"]

print(train(1000))                           # 0.001: each attempt resumes at the last multiple of 100
