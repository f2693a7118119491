"""The runtime's global module hooks while a planned call runs (:class:`RegionsMixin`, composed
by :class:`~taichi_plan.runtime.mode.PlanRuntime`): module names as the recorder saw them, the
recorded module calls a live forward skipped (layerdrop), and the planned regions
(:mod:`taichi_plan.problem.partition.regions`), inside which the dispatch mode and the
saved-tensor hooks come on."""

from __future__ import annotations

import bisect
import sys

import torch

from .frame import Frame


class RegionsMixin:
    """The module hooks of :class:`~taichi_plan.runtime.mode.PlanRuntime`: skipped module
    calls and planned regions."""

    def _names_of(self, model) -> None:
        """Module names as the recorder saw them: ``model.named_modules()`` (cached per model)."""
        if self._names_root is not model:
            self._names = {id(m): name for name, m in model.named_modules()}
            self._names_root = model

    def _entered(self, module, _args) -> None:
        """A module's forward starts (a global pre-hook, installed while a planned call runs).

        Counting (over the whole call, or in a planned region): where its recorded call starts
        later than the op the call has reached, and a recorded module call starts there, the
        live forward skipped that call (and its caller's code after it, up to this module's):
        its ops never run, and the count moves on to this one. It finds what op names alone
        cannot, a skipped layer followed by a module that starts with the same ops (the head
        after a last layer skipped).

        Outside the planned regions, where no op is seen: a module called more often than in
        the recorded call is a mismatch (its ops are not in the trace); a recorded module call
        that starts between the last module called and this one was skipped (layerdrop), and
        the rest of the call is then counted as a whole call is (:meth:`_enter_rest`: a skip
        may change the shapes after it, Informer's skipped distilling convolution); a planned
        region's module call starts its region (:meth:`_enter_region`)."""
        frame = self._frame
        if (frame is None or not frame.enabled or frame.partition_depth or self.hidden
                or torch._C._current_graph_task_id() != -1):
            return
        name = self._names.get(id(module))
        if name is None:
            return
        starts = frame.call.module_starts.get(name, ())
        k = frame.module_seen.get(name, 0)
        frame.module_seen[name] = k + 1
        regions = frame.call.in_regions
        if k >= len(starts):
            if regions and name:  # (the op check sees it over a whole call)
                self._module_mismatch(frame, name, k + 1, len(starts))
            return
        want = starts[k]
        if not frame.counting:
            if regions and name:
                jumped = self._jumped(frame, want)
                frame.pos = want
                if jumped:
                    self._enter_rest(frame, want)
                    return
                region = frame.call.regions.get(name)
                if region is not None and k in region:
                    self._enter_region(frame, module, name, region[k])
            return
        frame.pos = max(frame.pos, want)
        n = self._skip(frame)
        if want <= n:
            return
        if self._note_skipped(frame, self._walk(frame, n, want)):
            frame.n = want

    def _note_skipped(self, frame: Frame, skipped: list | None) -> bool:
        """Note ``skipped`` (:meth:`_walk`'s) as module calls the live forward did not make;
        False when there was no walk (None)."""
        if skipped is None:
            return False
        frame.skipped.extend(skipped)
        self.skipped_calls += len(skipped)
        return True

    @staticmethod
    def _walk(frame: Frame, n: int, want: int) -> list | None:
        """The recorded module calls from counted op ``n`` up to ``want`` that a live forward
        skipped, outermost first, (module, op) each, the caller's own code between them
        skipped with them; None when no recorded module call starts at ``n``."""
        table = frame.call.module_calls
        if n not in table:
            return None
        skipped, p = [], n
        while p < want:
            fits = [(first, m) for first, _last, m in table.get(p, ()) if first <= want]
            if fits:  # outermost first
                skipped.append((fits[0][1], p))
                p = fits[0][0]
            else:  # the caller's own code between skipped calls
                p += 1
        return skipped

    def _jumped(self, frame: Frame, want: int) -> bool:
        """Outside the planned regions: did the live forward skip recorded module calls that
        start after the last module called (``frame.pos``) and before counted op ``want``?
        Notes the outermost of them as skipped."""
        entries = frame.call.entries
        lo, hi = bisect.bisect_right(entries, frame.pos), bisect.bisect_left(entries, want)
        found, past = False, -1
        for s in entries[lo:hi]:
            calls = frame.call.module_calls.get(s)
            if s < past or not calls:  # inside a call noted already, or a call of no ops
                continue
            end, _glue, m = calls[0]
            frame.skipped.append((m, s))
            self.skipped_calls += 1
            found, past = True, end
        return found

    def _enter_rest(self, frame: Frame, at: int) -> None:
        """Count the rest of the call from counted op ``at``, with the mode and hooks on until
        it ends, as a call run whole is (after a skipped module call: what runs after it may
        differ, and only op by op can that be seen)."""
        frame.n = at
        frame.region = (None, None, at, len(frame.call.ops) - 1, self._mode_on(frame))

    def _enter_region(self, frame: Frame, module, name: str, span: tuple[int, int]) -> None:
        """A planned region's module call starts (:mod:`taichi_plan.problem.partition.regions`): the op count
        moves to its recorded first op, and the mode and the saved-tensor hooks come on until
        it returns (:meth:`_left`)."""
        first, last = span
        frame.n = first
        frame.region = (module, name, first, last, self._mode_on(frame))
        self.regions_run += 1

    def _mode_on(self, frame: Frame):
        """Enter the dispatch mode and the saved-tensor hooks (the hooks innermost); returns
        the hooks' context, to leave after them."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook)
        self.__enter__()
        hooks.__enter__()
        frame.counting = True
        return hooks

    def _left(self, module, _args, _out) -> None:
        """A module's forward returned (a global forward hook, ``always_call``, while a planned
        call runs): where it is the planned region running now, the region ends."""
        frame = self._frame
        if frame is None or frame.region is None or frame.region[0] is not module:
            return
        self._leave_region(frame, check=sys.exc_info()[0] is None)  # (in its handler when the forward raised)

    def _leave_region(self, frame: Frame, check: bool = True) -> None:
        """End the planned region running now: the mode and hooks go off. ``check``: the
        region's module must have run every op of its recorded call (fewer are the iterations
        a loop over routed data did not run, else a mismatch); more ran as recorded, op by op."""
        _module, name, first, last, hooks = frame.region
        frame.region = None
        frame.counting = False
        frame.pos = max(frame.pos, last)
        try:
            hooks.__exit__(None, None, None)
        finally:
            self.__exit__(None, None, None)
        if not check or not frame.enabled:
            return
        n = self._skip(frame)
        if n <= last:
            at = self._past_iterations(frame, n, None, last + 1)
            if at is not None:
                self.skipped_sized_ops += at - n
                return
            if self._note_skipped(frame, self._walk(frame, n, last + 1)):  # its last module calls skipped (layerdrop)
                return
            self._frame_mismatch(frame, (
                f"Module {name!r} ran {n - first} ops in call {frame.call.index} of the model, where the plan's trace "
                f"has {last + 1 - first}. The model or its inputs changed since the trace was recorded: record and solve "
                "again, or apply the plan with on_mismatch='warn'."))

    def _end_regions(self, frame: Frame, failed: bool) -> None:
        """The end of a call run in planned regions: the recorded module calls after the last
        module called were skipped. A partitioned module whose wrapper did not run, and that no
        skipped call holds, ran its ops whole another way (a mismatch)."""
        if failed or not frame.enabled:
            return
        self._jumped(frame, len(frame.call.ops))  # the recorded module calls after the last one called: skipped
        self._missed_partition(frame)

    def _missed_partition(self, frame: Frame) -> bool:
        """At the end of a call: a partitioned module whose wrapper did not run, and that no
        skipped module call holds, ran its ops whole another way: a mismatch (True)."""
        gone = [m for m, _ in frame.skipped]
        missed = [m for m in frame.call.spans if m not in frame.entered
                  and not any(m == g or m.startswith(g + ".") for g in gone)]
        if not missed:
            return False
        self._frame_mismatch(frame, (
            f"The plan partitions module {missed[0]!r}, but its forward was not called in call "
            f"{frame.call.index} of the model, so its ops ran whole and the plan's memory prediction does "
            "not hold. The model's code reaches that module's ops another way than through its forward: "
            "record and solve again."), ended=True)
        return True
