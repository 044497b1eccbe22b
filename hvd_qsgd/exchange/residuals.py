"""The exchange runner's error-feedback steps (the rules: ``hvd_qsgd.error_feedback``; the store:
``hvd_qsgd.state.ResidualStore``): what a chain's encode reads and rewrites as this rank's residual,
and the reducing rank's server residual. A fusion buffer's residual is its members', each kept under
its member's own key (``hvd_qsgd.exchange.buffers``). After Horovod is initialised again, what the
unfinished exchanges and the residuals held is dropped (``new_session``)."""
from hvd_qsgd import protocol, reduction, report
from hvd_qsgd.state import element_count


class ResidualSteps:
    """Mixed into ``ExchangeRunner``, whose ``residuals``, ``buffers``, ``lock``, ``names``, ``session``,
    ``session_lock``, ``owner`` and ``reset`` it uses."""

    def worker_residual(self, ex, x, size=None):
        """(the buffer the backend's encode reads and rewrites as the residual of what this rank
        encodes, ``size`` elements (default: the tensor's), whether it holds one): with error
        feedback, the residual kept, where ``x`` is, rescaled by lr_made / lr_now; else (None, False)."""
        if not ex.settings.error_feedback:
            return None, False
        if ex.offsets is not None and size is None:  # a fusion buffer: its members' residuals
            return self.buffers.residual(self, ex, x)
        size = ex.expect.numel if size is None else size
        kept = self.kept_residual(ex, x, size)
        return (ex.backend.zeros(size, x), False) if kept is None else (kept, True)

    def kept_residual(self, ex, x, size):
        """The residual kept for what this rank encodes of ``ex`` (``size`` elements, checked), where
        ``x`` is, rescaled by lr_made / lr_now; None if none is kept."""
        old = self.check_residual(ex, size)
        if old is None:
            return None
        residual = ex.backend.place(old, x)
        factor = self.residuals.factor(ex.route.residual_key, ex.lr)
        return residual if factor == 1.0 else residual * factor

    def check_residual(self, ex, size):
        """The residual kept for what this rank encodes (None if none), after checking that it has
        ``size`` elements."""
        key = ex.route.residual_key
        old = self.residuals.get(key) if ex.settings.error_feedback else None
        if old is not None and element_count(old) != size:
            raise protocol.MismatchError(
                f"{ex.where}: its error-feedback residual "
                f"({'position' if isinstance(key, int) else 'parameter' if ex.route.param is not None else 'name'} "
                f"{key!r}) has {element_count(old)} elements, what this rank encodes {size}: load_state_dict loaded "
                "a checkpoint of another model or job, the tensors handed to the compressor changed order between "
                "steps (pass named_parameters= to the compressor), two tensors were given one name=, or the node layout "
                "changed")
        return old

    def keep_residual(self, ex, residual):
        if residual is not None and ex.offsets is not None and (
                type(residual) is list or element_count(residual) == ex.expect.numel):
            self.buffers.keep_residuals(self, ex, residual)   # (a list: the members' own, where they are)
        elif residual is not None:
            self.residuals.keep(ex.route.residual_key, residual, ex.lr)

    def server_residual(self, ex, like):
        """This rank's residual of the tensor's chunk, where its backend reduces ``like`` (made zero,
        or moved there once from a checkpoint); the reduce step updates it in place."""
        begin, end = reduction.chunk_ranges(ex.expect.numel, ex.settings.bucket_size, len(ex.set_ranks))[ex.set_rank]
        with self.lock:
            return self.residuals.server_residual(ex.route.residual_key, end - begin,
                                                  lambda size: ex.backend.zeros(size, like), ex.where,
                                                  lambda r: ex.backend.place(r, like))

    def new_session(self, session, also_reset=None):
        """The exchanges to come are in Horovod session ``session`` (an object Horovod makes anew at
        every init); True where it follows another, in which this compressor exchanged: an elastic
        reset under Horovod's own state object, which does not know the compressor. The exchanges
        left unfinished would never be waited on, and would route later gradients of their
        parameters to numbered exchanges, whose residuals pile up by position: they are forgotten,
        and the residuals dropped, as ``hvd_qsgd.torch.elastic.TorchState`` does at a reset (it also
        rolls the exchange counters back to the commit), saying so where anything was dropped;
        ``also_reset``: what the adapter resets with them."""
        with self.session_lock:   # (set once the reset is done: an exchange that sees it opens after)
            before = self.session
            if before is session:
                return False
            unfinished = self.names.pending
            dropped = unfinished or self.residuals.residuals or self.residuals.server
            if before is not None:
                self.reset(residuals=True)
                if also_reset is not None:
                    also_reset()
            self.session = session
        if before is None:
            return False
        if dropped:
            report.log.warning(
                "%s: Horovod was initialised again (an elastic reset?) with %d exchange(s) of this compressor "
                "unfinished: they are forgotten and its error-feedback residuals dropped, as "
                "hvd_qsgd.torch.elastic.TorchState does at a reset (use it to carry the compressor: it also rolls "
                "the exchange counters back to the commit)", self.owner, unfinished)
        return True
