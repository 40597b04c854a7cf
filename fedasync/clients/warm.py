"""The warm trainer of one device: torch, the ClientApp, the data and the model loaded once, and
one task process per message forked from it.

``fedasync client`` runs its SuperNode with ``--isolation process`` (Flower's mode for a
separately managed app executor) and starts this module next to it (see
:mod:`fedasync.deploy.supernode`). It does what Flower's ``flower-superexec`` and
``flwr-clientapp`` do, with Flower's own functions, in a process that is already warm:

1. it loads the ClientApp and starts asking the SuperNode's Runtime API for a task
   (``AcquireTask``, every ``poll_interval``); while idle it loads torch and the task code in
   steps (:data:`PRELOAD_STEPS`, with one toy SGD step so that torch's lazy set-up is done here)
   so that the server's hello is answered at once and a train task finds them loaded;
2. it pulls the task's input (message, context, run, FAB) with the task's token, installs the
   FAB and loads the ClientApp once per FAB;
3. it forks a task process, which sends the task's heartbeats, runs the ClientApp
   (``fedasync.clients.app``: training, signing), pushes the reply and the task's output, and
   exits; meanwhile the trainer loads a train task's data and (on the CPU) its model into its
   own caches (:func:`fedasync.clients.runner.warm`), so that the next forks find them, and then
   waits for the task process.

A task process that dies before its reply (killed, out of memory) costs that task only: the
trainer pushes an error reply in its place, which the server records as ``failed``. If the
trainer itself dies, its task process carries on (it watches the SuperNode, not the trainer)
and ``fedasync client`` starts a new trainer. Nothing here touches a GPU before the fork (CUDA
does not survive one): a task on ``cuda``/``mps`` builds its model in its own process.

Run as ``python -m fedasync.clients.warm --runtime-api-address 127.0.0.1:PORT --parent-pid PID``:
with ``--parent-pid`` it first waits until that process (its SuperNode) listens on PORT, and exits
(status 3) instead of serving a Runtime API another process holds there (Linux: /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

PUSHED = b"R"  # what a task process writes to its pipe once its reply is pushed


def _say(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} fedasync trainer [{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def _torch_warmup() -> None:
    """One SGD step on a toy model: torch's lazy set-up (optimizer, autograd; seconds) happens here,
    once, not in every forked task process. CPU only, one thread (no OpenMP pool before a fork)."""
    import torch

    torch.set_num_threads(1)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    loss = torch.nn.CrossEntropyLoss()(m(torch.zeros(2, 4)), torch.tensor([0, 1]))
    opt.zero_grad()
    loss.backward()
    opt.step()


def _import(name: str):
    def step() -> None:
        __import__(name)
    return step


# what a train task needs, loaded while the trainer is idle (a hello needs none of it)
PRELOAD_STEPS = [_import("torch"), _torch_warmup, _import("fedasync.clients.runner"), _import("fedasync.task.data"),
                 _import("fedasync.task.models"), _import("fedasync.task.train"), _import("sklearn.datasets"),
                 _import("fedasync.signing"), _import("fedasync.server.strategies")]


def preload() -> None:
    """Everything at once (tests, and a train task that comes before the idle time did it)."""
    for step in PRELOAD_STEPS:
        step()


def _client(address: str, token: str | None = None, component: str = "SuperExec"):
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker())


def _listening_inodes(port: int) -> set[int] | None:
    """Socket inodes of the TCP listeners on ``port`` (any local address), from /proc/net/tcp and
    tcp6; None where there is no /proc to read (not Linux)."""
    found, read = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(int(cols[9]))
    return found if read else None


def runtime_api_owner(port: int, pid: int) -> str:
    """Who listens on TCP ``port`` (the SuperNode's Runtime API): ``"parent"`` (only process
    ``pid``), ``"other"`` (a socket there is not ``pid``'s: another SuperNode), ``"none"``
    (nothing yet) or ``"unknown"`` (no /proc to tell)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return "unknown"
    if not inodes:
        return "none"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return "unknown" if not os.path.isdir("/proc/self/fd") else "other"
    own = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            own.add(int(link[8:-1]))
    return "parent" if inodes <= own else "other"


class WarmTrainer:
    """One device's trainer: acquires the SuperNode's tasks and runs each in a forked process.
    Given its SuperNode's pid, it serves only a Runtime API that this process listens on."""

    def __init__(self, address: str, supernode_pid: int | None = None, poll_interval: float = 0.1):
        self.address = address
        self.supernode_pid = supernode_pid
        self.poll_interval = poll_interval
        self.apps: dict[str, object] = {}  # FAB hash -> ClientApp
        self.tasks = 0
        self.todo = list(PRELOAD_STEPS)
        self.warmed: set[tuple] = set()  # (setup, client id, data path) loaded here
        self.t0 = time.monotonic()

    def preload_step(self) -> bool:
        """One preload step; False when there is nothing left."""
        if not self.todo:
            return False
        step = self.todo.pop(0)
        try:
            step()
        except ImportError as e:  # e.g. no scikit-learn: the task itself will say what is missing
            _say(f"preload: {e}")
        if not self.todo:
            _say(f"warm: torch and the task code loaded in {time.monotonic() - self.t0:.1f} s")
        return True

    def wait_for_parent(self) -> bool:
        """Wait (preloading meanwhile) until the SuperNode that started this trainer listens on
        the Runtime API port it was given; False if another process listens there (two
        SuperNodes given one port: the other's tasks are not this device's to run)."""
        if self.supernode_pid is None:
            return True
        port = int(self.address.rsplit(":", 1)[1])
        while True:
            owner = runtime_api_owner(port, self.supernode_pid)
            if owner == "parent":
                return True
            if owner == "unknown":
                _say(f"cannot tell who listens on port {port} (no /proc): trusting it is SuperNode "
                     f"{self.supernode_pid}")
                return True
            if owner == "other":
                _say(f"port {port} is another process's, not this SuperNode's (pid {self.supernode_pid}): "
                     "not serving it")
                return False
            if not self.preload_step():
                time.sleep(0.1)

    def serve(self) -> None:
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
        from flwr.supercore.constant import TaskType

        if not self.wait_for_parent():
            raise SystemExit(3)
        client = _client(self.address)
        req = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        _say(f"ClientApp loaded; polling the SuperNode at {self.address}")
        while True:
            try:
                res = client.AcquireTask(req)
            except Exception as e:  # the SuperNode is starting or gone: its monitor ends us
                _say(f"AcquireTask failed ({type(e).__name__}); retrying")
                time.sleep(1.0)
                continue
            if res.HasField("task") and res.token:
                self.run_task(res.token, res.task)
            elif not self.preload_step():
                time.sleep(self.poll_interval)

    # -- one task ----------------------------------------------------------------------
    def _app(self, run, fab):
        """Install the FAB and load its ClientApp, once per FAB."""
        app = self.apps.get(fab.hash_str)
        if app is None:
            from flwr.cli.install import install_from_fab
            from flwr.clientapp.utils import get_load_client_app_fn

            install_from_fab(fab.content, skip_prompt=True)
            app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(
                run.fab_id, run.fab_version, fab.hash_str)
            self.apps[fab.hash_str] = app
        return app

    def _warm_for(self, message, context) -> None:
        """Load this train task's data and model here, so that the next forks find them."""
        if message.metadata.message_type != "train":
            return
        from fedasync.clients.app import task_config
        from fedasync.clients.runner import warm

        try:
            node_cfg = dict(context.node_config or {})
            config = task_config(message, node_cfg)
            key = (config["setup"], int(config.get("client_id", 0)), node_cfg.get("data-path") or None,
                   str(node_cfg["task"]) if node_cfg.get("task") else None,
                   bool(config.get("deployment")) or bool(node_cfg.get("deployed")))  # as app.train passes them
            if key in self.warmed:
                return
            warm(*key)
            self.warmed.add(key)
        except Exception as e:  # the task process will meet (and report) the same problem
            _say(f"could not preload the task's data ({type(e).__name__}: {e})")

    def run_task(self, token: str, task) -> None:
        self.tasks += 1
        t0 = time.monotonic()
        client = _client(self.address, token, "flwr-clientapp")
        message = context = None
        try:
            message, context, run, fab = pull_task_input(client)
            t_pull = time.monotonic() - t0
            app = self._app(run, fab)
            if message.metadata.message_type == "train":
                while self.preload_step():
                    pass
        except Exception as e:
            _say(f"task {task.task_id}: could not start ({type(e).__name__}: {e})")
            if message is not None:  # an error reply, as flwr-clientapp sends when the app does not load
                self._fail(client, message, context, f"{type(e).__name__}: {e}")
            # else the task's claim expires and Flower's SuperNode answers for it
            client.close()
            return
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the task process
            os.close(r)
            code = 1
            try:
                code = _task_process(self.address, token, message, context, app, w, self.supernode_pid)
            finally:
                os._exit(code)
        os.close(w)
        _say(f"task {task.task_id} ({message.metadata.message_type}) in process {pid} (input pulled in "
             f"{t_pull:.2f} s, forked at {time.monotonic() - t0:.2f} s)")
        self._warm_for(message, context)  # the next task's data and model, while this one runs
        limit = task_deadline(message)
        pushed, status, hung = wait_task_process(pid, r, t0 + limit)
        _say(f"task {task.task_id} done in {time.monotonic() - t0:.2f} s")
        if PUSHED not in pushed:
            if hung:
                why = f"no reply after {limit:.0f} s; killed"
            else:
                why = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"exit status {os.WEXITSTATUS(status)}")
            _say(f"task {task.task_id}: its process died before replying ({why}); sending an error reply")
            self._fail(client, message, context, f"fedasync task process {'hung' if hung else 'died'} ({why})")
        elif hung:
            _say(f"task {task.task_id}: its process hung after its reply; killed")
        client.close()

    @staticmethod
    def _fail(client, message, context, reason: str) -> None:
        """The error reply and the failed status a dead task process could not send."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        try:
            push_message(client, Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                                         reply_to=message), context)
            push_task_output(client, context, SubStatus.FAILED, reason)
        except Exception as e:
            _say(f"could not send the error reply ({type(e).__name__}: {e})")


DEFAULT_TASK_DEADLINE_S = 4 * 3600.0  # a task whose config carries no task_timeout
DEADLINE_GRACE_S = 60.0  # past the task's timeout: a late reply may still be used (server.late_policy)


def task_deadline(message) -> float:
    """Seconds a task process may take before the trainer kills it (a hung task process must not
    take the device out for good): twice the task's ``task_timeout`` (the server's, carried in a
    train task's config) plus a grace, else :data:`DEFAULT_TASK_DEADLINE_S`; never past the
    message's TTL (its reply would be dropped by then anyway)."""
    limit = DEFAULT_TASK_DEADLINE_S
    try:
        timeout = json.loads(message.content["task"]["json"]).get("task_timeout")
        if timeout:
            limit = 2 * float(timeout) + DEADLINE_GRACE_S
    except Exception:  # a hello or a malformed task: the default
        pass
    ttl = getattr(message.metadata, "ttl", None)
    if ttl and ttl > 0:
        limit = min(limit, float(ttl))
    return max(1.0, limit)


def wait_task_process(pid: int, pipe_r: int, deadline: float) -> tuple[bytes, int, bool]:
    """Read the task process's pipe until it closes, then reap it; past ``deadline`` (monotonic)
    SIGKILL it. (what it wrote, its wait status, whether it was killed for the deadline);
    closes ``pipe_r``."""
    import select

    pushed, hung = b"", False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                break
            ready, _, _ = select.select([pipe_r], [], [], min(left, 5.0))
            if not ready:
                continue
            chunk = os.read(pipe_r, 64)
            if not chunk:
                break
            pushed += chunk
        while not hung:  # the pipe closed: the process exits (or hangs on its way out)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return pushed, status, False
            if time.monotonic() >= deadline:
                hung = True
                break
            time.sleep(0.05)
    finally:
        os.close(pipe_r)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    return pushed, status, True


def pull_task_input(client):
    """Flower's ``pull_task_input`` (``flwr.supernode.runtime.run_clientapp``), polling for the
    message's objects every 0.05 s at first instead of 1 s: the SuperNode hands out the task
    while it is still downloading the message from the SuperLink."""
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf, make_pull_object_fn_protobuf)
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    from flwr.app import Message

    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=0.05, backoff_cap=1.0)
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


def _task_process(address: str, token: str, message, context, app, pipe_w: int, supernode_pid: int | None) -> int:
    """In the forked task process: what ``flwr-clientapp`` does after loading the app."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.app_utils import start_parent_process_monitor
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if supernode_pid is not None:
        start_parent_process_monitor(supernode_pid)  # the SuperNode gone: this task is moot
    client = _client(address, token, "flwr-clientapp")
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    code = 0
    try:
        reply = app(message=message, context=context)
        sub_status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # as flwr-clientapp: an error reply, the task failed
        reason = str(type(ex)) + ":<'" + str(ex) + "'>"
        _say(f"the ClientApp raised {reason}")
        reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
        sub_status, details, code = SubStatus.FAILED, reason, 3
    try:
        push_message(client, reply, context)
    except Exception as ex:
        _say(f"could not push the reply ({type(ex).__name__}: {ex})")
        return 4
    try:
        os.write(pipe_w, PUSHED)
    except OSError:  # the trainer died meanwhile: nobody to tell
        pass
    push_task_output(client, context, sub_status, details)
    heartbeat.stop()
    client.close()
    return code


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="fedasync warm trainer (started by `fedasync client`)")
    ap.add_argument("--runtime-api-address", default="127.0.0.1:9094")
    ap.add_argument("--parent-pid", type=int, default=None, help="the SuperNode: exit when it exits")
    ap.add_argument("--poll-interval", type=float, default=0.1, help="seconds between AcquireTask calls")
    args = ap.parse_args(argv)
    import fedasync.clients.app  # noqa: F401  (the hello needs only this; torch follows while idle)
    import flwr.supernode.runtime.run_clientapp  # noqa: F401

    if args.parent_pid is not None:
        from flwr.supercore.app_utils import start_parent_process_monitor

        start_parent_process_monitor(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        WarmTrainer(args.runtime_api_address, args.parent_pid, args.poll_interval).serve()
    except KeyboardInterrupt:  # the SuperNode exited (its monitor raises SIGINT)
        pass


if __name__ == "__main__":
    main()
