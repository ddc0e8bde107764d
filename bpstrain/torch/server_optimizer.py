"""DistributedOptimizer under ``comm.consistency`` ``ssp:<s>`` or ``async``: the servers
hold the weights and step them; this rank pushes gradients and pulls weights.

    bps.init({"consistency": "ssp:4"})      # or BPSTRAIN_CONSISTENCY=ssp:4 on every rank
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    loss.backward()     # each gradient is pushed as soon as it is ready
    optimizer.step()    # waits for the servers' weights and copies them into the model

The first ``step()`` is collective: every rank sends its parameters, the servers keep
rank 0's (so every rank starts from rank 0's model, as after ``broadcast_parameters``)
together with the optimizer's hyperparameters; their optimizer state (momentum, Adam's
moments) lives on the servers from then on. ``torch.optim.SGD`` (momentum, dampening,
Nesterov, weight decay) and ``torch.optim.Adam`` (betas, eps, weight decay) are
supported, with torch's own arithmetic (ssp:0 equals synchronous training bit for bit
with two workers); each step's learning rate is read from the parameter group when its
gradient is pushed, so learning-rate schedulers work. What the servers do per mode:
:mod:`core_ext/src/param_store.h`.

Not here: compression and ``op=Sum`` (the servers average), local accumulation
(``backward_passes_per_step`` > 1), and the servers' optimizer state in
``state_dict()`` (a resumed job restarts momentum/moments from zero; the weights come
from the model, as at the first step). A parameter without a gradient on this rank
pushes zeros (every rank pushes every parameter each step, or the clocks would part),
so momentum and weight decay still move it.
"""

from __future__ import annotations

import itertools

import torch

from bpstrain import engine
from bpstrain.engine import Op
from bpstrain.torch.optimizer import parameter_names

_instances = itertools.count()


def server_optimizer_spec(kind: type, group: dict) -> str:
    """The servers' optimizer for one parameter group of a ``kind`` optimizer (the
    wrapped class), as param_store.h parses it.

    Raises:
        ValueError: an optimizer or option the servers do not implement, naming it.
    """
    if group.get("maximize"):
        raise ValueError("server-held weights (comm.consistency ssp/async) do not support maximize=True")
    if kind is torch.optim.SGD:
        return (f"sgd momentum={float(group['momentum'])!r} dampening={float(group['dampening'])!r} "
                f"nesterov={int(bool(group['nesterov']))} weight_decay={float(group['weight_decay'])!r}")
    if kind is torch.optim.Adam and not group.get("amsgrad") and not group.get("decoupled_weight_decay"):
        beta1, beta2 = (float(b) for b in group["betas"])
        return (f"adam beta1={beta1!r} beta2={beta2!r} eps={float(group['eps'])!r} "
                f"weight_decay={float(group['weight_decay'])!r}")
    raise ValueError(
        "server-held weights (comm.consistency ssp/async) step torch.optim.SGD or torch.optim.Adam "
        "(no amsgrad) on the servers; use comm.consistency=sync for other optimizers. Received: "
        f"{kind.__name__}")


class _ServerOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class (see _wrap)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 fusion_threshold_bytes, average=True, catch_up=False):
        super(self.__class__, self).__init__(params)
        if catch_up:
            raise ValueError("catch_up is for k-of-n aggregation in sync training; ssp/async never wait "
                             "for a slow worker")
        from bpstrain.torch.compression import Compression

        if compression is not Compression.none:
            raise ValueError("comm.consistency ssp/async sends uncompressed gradients; drop compression= "
                             f"or use comm.consistency=sync. Received: compression={compression!r}")
        if backward_passes_per_step != 1:
            raise ValueError("comm.consistency ssp/async pushes every backward pass; accumulate locally "
                             "before backward or use sync. Received: backward_passes_per_step="
                             f"{backward_passes_per_step}")
        if not average:
            raise ValueError("comm.consistency ssp/async averages gradients on the servers; op=Sum "
                             "is sync-only")
        params = [p for group in self.param_groups for p in group["params"]]
        by_id = parameter_names(params, named_parameters)
        prefix = f"ServerOptimizer.{next(_instances)}.param."
        self._bps_names = {id(p): prefix + by_id[id(p)] for p in params}
        self._bps_priority = {id(p): -i for i, p in enumerate(params)}
        self._bps_group = {id(p): g for g in self.param_groups for p in g["params"]}
        self._bps_spec = {id(p): server_optimizer_spec(type(self).__bases__[0], g) for g in self.param_groups for p in g["params"]}
        for p in params:
            if p.dtype != torch.float32:
                raise ValueError("comm.consistency ssp/async keeps fp32 weights on the servers; keep fp32 "
                                 f"parameters (autocast computes in half precision). Received: {p.dtype}")
        self._bps_active = engine.env().distributed
        self._bps_initialised = False
        self.rounds = 0  # steps taken (as DistributedOptimizer's)
        self._bps_pending = {}  # id(p) -> (p, handle, host weights)
        if self._bps_active:
            for p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._bps_hook)

    def _bps_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _bps_hook(self, p):
        if self._bps_initialised and id(p) in self._bps_names:
            self._bps_push(p)

    def _bps_push(self, p):
        if id(p) in self._bps_pending:
            raise AssertionError("a gradient was computed twice before step(): comm.consistency ssp/async "
                                 "pushes each backward pass (call step() after every backward)")
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if grad.is_sparse:  # the servers hold the whole table: its dense gradient
            grad = grad.to_dense()
        src = grad.detach().to("cpu", torch.float32).contiguous()
        dst = torch.empty_like(src)
        lr = float(self._bps_group[id(p)]["lr"])
        handle = engine.submit_at(self._bps_names[id(p)], "float32", tuple(p.shape) or (1,), src, dst,
                                  src.numel() * 4, Op.SUM, self._bps_priority[id(p)], param=2, lr=lr)
        self._bps_pending[id(p)] = (p, handle, dst)

    def initialize_server_weights(self):
        """Collective: the servers take rank 0's parameters (and this optimizer's
        hyperparameters, fresh optimizer state), and every rank's parameters become rank
        0's. The first ``step()`` does it by itself; calling it before the first backward
        lets that step's gradients overlap backward too, and calling it again restarts
        the servers from the model as it is now (e.g. after loading a checkpoint)."""
        if self._bps_pending:
            raise AssertionError("initialize_server_weights() while gradients are in flight; call step() first")
        if self._bps_active:
            self._bps_initialise()

    def _bps_initialise(self):
        handles = []
        for p in self._bps_params():
            src = p.detach().to("cpu", torch.float32).contiguous()
            dst = torch.empty_like(src)
            handles.append((p, dst, engine.submit(
                self._bps_names[id(p)], "float32", tuple(p.shape) or (1,), src.numpy(), dst.numpy(),
                Op.BROADCAST, root=0, param=1, server_optimizer=self._bps_spec[id(p)])))
        with torch.no_grad():
            for p, dst, handle in handles:
                engine.synchronize(handle)
                p.copy_(dst.view_as(p))
        self._bps_initialised = True

    def in_flight(self) -> int:
        """Gradients pushed and not yet answered with weights."""
        return len(self._bps_pending)

    def synchronize(self):
        """Pushes the gradients whose hooks did not fire (the first step, unused parameters),
        then waits for the servers' weights and copies them into the parameters."""
        if not self._bps_active:
            return
        if not self._bps_initialised:
            self._bps_initialise()
        for p in self._bps_params():
            if p.requires_grad and id(p) not in self._bps_pending:
                self._bps_push(p)
        pending, self._bps_pending = self._bps_pending, {}
        with torch.no_grad():
            for p, handle, dst in pending.values():
                engine.synchronize(handle)
                p.copy_(dst.view_as(p))

    def step(self, closure=None):
        """Runs ``closure`` if given, then takes the servers' weights (the servers stepped
        the optimizer; the wrapped one is not called). Standalone (one process) it is
        the wrapped optimizer's step."""
        self.rounds += 1
        if not self._bps_active:
            return super(self.__class__, self).step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Like the wrapped optimizer's; refused while gradients are in flight."""
        if self._bps_pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step(): the pushed gradients are still being read")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)
