"""The mutants ``scripts/mutants.py`` runs: one guard each, removed by a literal edit.

Each names the file, the text that must occur in it exactly once, what replaces it, and the
tests that must then fail. Grouped as docs/architecture.md lists the guards ("Guards and the
tests that fail without them").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    more: tuple[tuple[str, str, str], ...] = ()  # further (path, old, new) edits, same mutant

    def edits(self) -> list[tuple[str, str, str]]:
        return [(self.path, self.old, self.new), *self.more]


VLLM = "tests/connector/vllm/"
STEPS = "tests/daemon/control/test_steps.py::"
EARMARKS = "tests/daemon/store/test_earmarks.py::"
MUTANTS = [
    Mutant("post-copy generation check removed", "connector/vllm/worker.py",
           "ok = self._intact(self._pool, check[2], check[3])", "ok = True",
           (VLLM + "test_frozen_engines.py::test_a_load_whose_slot_went_to_another_writer"
            "_mid_copy_is_recomputed",)),
    # Its test holds the worker between opening the lock file and taking the lock: the only
    # window where the lock alone cannot keep it out of re-granted slots. (The frozen-before-
    # the-lock test never reached it: once the daemon unlinks the revoked session's file the
    # worker cannot open it, so that test passes with or without the check.)
    Mutant("store pre-check removed", "connector/vllm/worker.py",
           "keep = placed & view.intact_mask(items[:, 2], gens, key_bound=False)",
           "keep = placed",
           (VLLM + "test_store_precheck.py",)),
    Mutant("worker takes no writers' lock", "connector/writer_lock.py",
           "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)", "pass",
           (VLLM + "test_frozen_engines.py::test_a_frozen_writers_late_store_never_overwrites"
            "_another_writers_block[copy]",)),
    Mutant("the manager's store spec names no writers' lock", "connector/vllm/manager.py",
           '        lock = self.session.reg.readers_path if self.session.reg is not None else ""',
           '        lock = ""',
           (VLLM + "test_frozen_engines.py::test_a_frozen_writers_late_store_never_overwrites"
            "_another_writers_block[copy]",)),
    Mutant("revoked grants not quarantined", "daemon/store/index.py",
           "self.reclaimer.quarantine(writers, [slot])", "self.pool.free(slot)",
           ("tests/daemon/control/test_quarantine.py",)),
    Mutant("quarantine ends while a writer holds the lock", "daemon/store/session_file.py",
           "fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
           ("tests/daemon/control/test_quarantine.py",)),
    Mutant("revocation keeps the generation", "daemon/store/index.py",
           "        self._bump(slot)\n        self.state[slot] = SlotState.RETIRED",
           "        self.state[slot] = SlotState.RETIRED",
           ("tests/daemon/control/test_quarantine.py",)),
    Mutant("heartbeat does not renew the lease", "daemon/control/leases.py",
           "if c.session is not None and now", "if False and now",
           ("tests/daemon/control/test_quarantine.py::test_an_idle_engine_keeps_its_grants",)),
    Mutant("re-attach keeps the earlier session", "daemon/control/service.py",
           "            self._supersede_session(client, msg.supersedes)\n",
           "            pass\n",
           ("tests/daemon/control/test_quarantine.py::test_a_re_attached_engine_releases_its"
            "_earlier_session_at_once",)),
    Mutant("a reused pool ignores the previous daemon's writers", "daemon/store/index.py",
           "            return True  # a previous daemon's writer may still copy into any free slot",
           "            pass",
           ("tests/daemon/state/test_restart_writers.py",)),
    Mutant("SIGTERM supersedes at once (no drain)", "daemon/server.py",
           "        while (self.index.n_pinned and loop.time() < deadline\n",
           "        while (False and loop.time() < deadline\n",
           (VLLM + "test_daemon_drain.py",)),
    Mutant("a draining daemon refuses an engine's Step", "daemon/control/service.py",
           "                                                  p.Bye, p.Step)):",
           "                                                  p.Bye)):",
           (VLLM + "test_daemon_drain.py",)),
    Mutant("reclamation ignores the reader floor", "daemon/store/reclaim.py",
           "        while self._retired and (floor is None or self._retired[0][0] <= floor):",
           "        while self._retired:",
           ("tests/daemon/store/test_reclaim.py",)),
    Mutant("a stuck reader holds retired slots forever", "daemon/store/reclaim.py",
           "                elif now - r.blocking_since > self.hold_s:",
           "                elif False:",
           ("tests/daemon/store/test_reclaim.py",
            VLLM + "test_stuck_readers.py")),
    Mutant("pins accept any generation", "daemon/store/index.py",
           "if not 0 <= slot < len(self.state) or self.gen[slot] != gen:",
           "if not 0 <= slot < len(self.state):",
           ("tests/daemon/store/test_reclaim.py",)),
    Mutant("seqlock retry ignored", "connector/index_view.py",
           "return rows, (seq == again) & (seq & 1 == 0) & (rows[\"seq\"] == seq)",
           "return rows, np.ones(len(slots), dtype=bool)",
           ("tests/daemon/store/test_concurrent_index.py",)),
    Mutant("seqlock ignored by a refresh of a few records (entry by entry)",
           "connector/view_few.py",
           "if seq == seq2 and not seq & 1 and _SEQ(raw)[0] == seq:", "if True:",
           ("tests/daemon/store/test_concurrent_index.py",)),
    Mutant("a few records' refresh keeps READY a slot that left the namespace",
           "connector/view_few.py", "        if gone:  # no key of ours", "        if False:  #",
           ("tests/connector/test_view_few.py",)),
    Mutant("the ident word's key tag ignored", "connector/index_map.py",
           "current = np.where(want >> _HALF != 0, current, current & _MASK)",
           "current, want = current & _MASK, want & _MASK",
           ("tests/daemon/store/test_shared_index.py",)),
    Mutant("attach waits on the step", "connector/session.py",
           "        self._attaching.start()\n", "        self._attaching.start()\n"
           "        self._attaching.join()\n",
           (VLLM + "test_step_never_waits.py",)),
    Mutant("a request waits on another engine's PENDING key without a bound",
           "connector/vllm/waits.py", "        if self._now - first <= self.wait_s:",
           "        if True:", (VLLM + "test_pending_wait.py",)),
    Mutant("own stores forgotten once committed (vLLM recomputes them)",
           "connector/vllm/own_stores.py", "    (S.WRITING, E.STORED): (S.COMMITTED, A.COMMIT),",
           "    (S.WRITING, E.STORED): (None, A.COMMIT),",
           (VLLM + "test_own_stores.py::test_own_commits_load_while_the_daemon_is_stopped",),
           # Both ways into COMMITTED: which one a run takes depends on whether the claim's
           # reply or the workers' done is read first (a loaded CI host took the other one).
           (("connector/vllm/own_stores.py", "    (S.DONE_EARLY, E.APPLIED): (S.COMMITTED, A.NONE),",
             "    (S.DONE_EARLY, E.APPLIED): (None, A.NONE),"),)),
    Mutant("a load's ident carries no tag of the key asked for (a hash collision loads)",
           "connector/ready_table.py", "        return slot, si.ident(self._g[slot], key)",
           "        return slot, si.ident(self._g[slot], None)",
           ("tests/connector/test_ready_table.py",)),
    Mutant("own stores settled against a lagging view", "connector/vllm/own_stores.py",
           "lags = self._keys, None if view.caught_up else view.lags",
           "lags = self._keys, None",
           ("tests/connector/test_index_view.py",)),
    Mutant("a budgeted refresh defers removals and reassignments (stale READY answers)",
           "connector/index_view.py", "        wait = ours & ~self.ready.holding(slots) \\\n",
           "        wait = (ours | ~ours) \\\n",
           ("tests/connector/test_index_view.py",)),
    Mutant("keys of a batched put that meet at one empty bucket all take it",
           "connector/ready_table.py", "                fi, p, s = fi[won], p[won], s[won]\n",
           "", ("tests/connector/test_ready_table.py",)),
    Mutant("one key in two entries of a refresh put in the table as a batch",
           "connector/index_view.py",
           "        plain = (states == si.READY) & view_rows.alone(hashes)\n",
           "        plain = states == si.READY\n", ("tests/connector/test_view_batches.py",)),
    Mutant("a READY entry batched over another key's PENDING bookkeeping",
           "connector/view_pending.py", "            plain[at[~ok]] = False\n", "",
           ("tests/connector/test_view_batches.py",)),
    Mutant("a claim batched over a slot holding a READY key (left READY there)",
           "connector/view_pending.py",
           "claims & ~self._pmask[slots] & ~self.ready.holding(slots))",
           "claims & ~self._pmask[slots])", ("tests/connector/test_view_pending.py",)),
    Mutant("a claim batched over a slot holding another PENDING key",
           "connector/view_pending.py",
           "claims & ~self._pmask[slots] & ~self.ready.holding(slots))",
           "claims & ~self.ready.holding(slots))", ("tests/connector/test_view_pending.py",)),
    Mutant("a claim batched though its key's hash is READY elsewhere (left READY there)",
           "connector/view_pending.py", "        at = at[self.ready.absent(hashes[at])]\n", "",
           ("tests/connector/test_view_pending.py",)),
    Mutant("a claim batched though its key is pending in another slot",
           "connector/view_pending.py",
           "        if pending_slot and ks and not pending_slot.keys().isdisjoint(ks):\n",
           "        if False:\n", ("tests/connector/test_view_pending.py",)),
    Mutant("one key in two entries of a refresh, a claim among them, batched",
           "connector/index_view.py", "            claims &= view_rows.alone(hashes)\n",
           "            pass\n", ("tests/connector/test_view_pending.py",)),
    Mutant("absent: a probe still running after the lockstep rounds answers absent",
           "connector/ready_table.py",
           "            at, hashes, pos = at[on], hashes[on], (pos[on] + 1) & mask\n"
           "        return out\n",
           "            at, hashes, pos = at[on], hashes[on], (pos[on] + 1) & mask\n"
           "        else:\n            out[at] = True\n        return out\n",
           ("tests/connector/test_ready_table.py",)),
    Mutant("absent: a tombstone taken for the end of a probe",
           "connector/ready_table.py", "            out[at[held < 0]] = True",
           "            out[at[(held < 0) | (hashes_at[pos] == -1)]] = True",
           ("tests/connector/test_ready_table.py",)),
    Mutant("reused blocks' touches ignored by the daemon", "daemon/control/steps.py",
           "                idx.touch(slot)  # READY only", "                pass  # READY only",
           ("tests/daemon/control/test_steps.py",)),
    Mutant("sync loads allowed (used before their check)", "connector/vllm/settings.py",
           "    if budget:\n        raise SettingError(", "    if False:\n        raise SettingError(",
           (VLLM + "test_start_checks.py",)),
    Mutant("load failures left to vLLM's 'fail' default", "connector/vllm/connector.py",
           '            kvt.kv_load_failure_policy = "recompute"', "            pass",
           (VLLM + "test_start_checks.py",)),
    Mutant("quotas counted per connection again", "daemon/control/quotas.py",
           '        return ("process", pid) if pid else ("client", client.identity)',
           '        return ("client", client.identity)',
           ("tests/daemon/control/test_quota_groups.py",)),
    Mutant("one namespace name with two geometries restored", "daemon/state/snapshot.py",
           "        elif by_name.setdefault(g.namespace, g) != g:",
           "        elif False:",
           ("tests/daemon/state/test_bad_state_dir.py",)),
    # Not bytes but stores: only keys vLLM offers again may be deferred a step.
    Mutant("a key vLLM offers once deferred (never offered again: lost)",
           "connector/vllm/manager.py",
           "            if res.covers(len(new)) and offered_again(self.requests.get(req_context"
           ".req_id),\n                                                      new, req_context,"
           " self._cow, self._block):",
           "            if res.covers(len(new)):",
           (VLLM + "test_long_prompts.py::test_a_ramp_of_tails_offered_once_drops_none",)),
    # Not bytes but stores: a reservation that does not follow the step's demand drops keys.
    Mutant("the store reservation ignores the steps' demand", "connector/vllm/reservation.py",
           "        return max(self.floor, HEADROOM * peak)", "        return self.floor",
           (VLLM + "test_long_prompts.py::test_a_128k_prompt_hits_what_vllms_own_manager"
            "_hits",)),
    # Not bytes but stores: keys vLLM offers once, dropped at a ramp, are never loadable.
    Mutant("a ramp's once-offered keys dropped, not topped up", "connector/vllm/manager.py",
           "            self._top_up(len(new))  # offered once only: the bounded wait of a ramp",
           "            pass",
           (VLLM + "test_long_prompts.py::test_a_ramp_of_tails_offered_once_drops_none",)),
    # Not bytes but hits: a tier's "not found" outlives this engine's own store of the key.
    Mutant("a key's own store does not clear its tier miss", "connector/vllm/waits.py",
           "        not_found = self._not_found\n        if not_found:",
           "        not_found = self._not_found\n        if False:",
           (VLLM + "test_tiers.py",)),
    # A claim names a slot of this engine's reservation at the generation it was granted at;
    # the commit, the claimed slot at that generation. Either check gone: two writers.
    Mutant("a claim of another engine's reserved slot accepted",
           "daemon/store/reservations.py",
           "or self.reserved_by.get(slot) is not holder or self.gen[slot] != gen:",
           "or self.gen[slot] != gen:",
           (STEPS + "test_a_claim_of_a_slot_the_engine_was_not_granted_is_refused_and_changes"
            "_nothing",)),
    Mutant("a claim at a stale generation accepted",
           "daemon/store/reservations.py",
           "or self.reserved_by.get(slot) is not holder or self.gen[slot] != gen:",
           "or self.reserved_by.get(slot) is not holder:",
           (STEPS + "test_a_claim_of_a_slot_the_engine_was_not_granted_is_refused_and_changes"
            "_nothing",)),
    Mutant("a commit at a stale generation accepted", "daemon/control/steps.py",
           "if slot != ref.slot or slot not in client.pending or idx.gen[slot] != ref.gen:",
           "if slot != ref.slot or slot not in client.pending:",
           (STEPS + "test_a_claim_of_a_slot_the_engine_was_not_granted_is_refused_and_changes"
            "_nothing",)),
    Mutant("a claim of a key stored meanwhile takes a second slot",
           "daemon/store/reservations.py",
           "            return None\n        if key in ns.keys:\n            return False\n"
           "        del self.reserved_by[slot]",
           "            return None\n        del self.reserved_by[slot]",
           (STEPS + "test_a_claim_of_a_key_stored_meanwhile_is_answered_exists_and_keeps_its"
            "_slot",)),
    Mutant("a store of a key stored meanwhile takes a second slot", "daemon/store/index.py",
           "        if key in ns.keys:\n            return Prepared(None, True, [])",
           "        if False:\n            return Prepared(None, True, [])",
           ("tests/daemon/store/test_index.py::test_no_room_when_all_pending_or_pinned",)),
    # A commit makes bytes loadable, an abort frees the slot: only the store's own client.
    Mutant("another engine's Step commit closes a store", "daemon/control/steps.py",
           "if slot != ref.slot or slot not in client.pending or idx.gen[slot] != ref.gen:",
           "if slot != ref.slot or idx.gen[slot] != ref.gen:",
           (STEPS + "test_only_the_client_holding_a_store_closes_it",)),
    Mutant("another client's CommitStore closes a store", "daemon/control/service.py",
           "            if slot is None or slot not in client.pending:\n"
           "                continue  # not a store of this client's",
           "            if slot is None:\n                continue  # not a store of this client's",
           (STEPS + "test_only_the_client_holding_a_store_closes_it",)),
    Mutant("an engine hands back another engine's reserved slot", "daemon/control/steps.py",
           "            if ref.slot in client.reserved:\n                client.reserved.discard(ref.slot)",
           "            if True:\n                client.reserved.discard(ref.slot)",
           (STEPS + "test_a_claim_of_a_slot_the_engine_was_not_granted_is_refused_and_changes"
            "_nothing",)),
    Mutant("an engine handle used by a client that did not register it",
           "daemon/control/service.py",
           "if engine is not None and engine not in client.engines:", "if False:",
           ("tests/daemon/control/test_errors.py::test_an_engine_handle_another_client"
            "_registered_is_not_this_clients",)),
    Mutant("a dead client's lease never ends (its pins and stores held forever)",
           "daemon/control/leases.py",
           "            if c.expires_at() > now:\n                continue",
           "            if True:\n                continue",
           ("tests/daemon/test_server.py::test_dead_writer_pending_store_is_released_after"
            "_lease",)),
    # A client without the writers' lock copies in its own process: its slots wait a lease.
    Mutant("a lockless client's stores reused at once when its lease ends",
           "daemon/control/upkeep.py",
           "fence_s = client.lease_ms / 1000 if fence else 0.0", "fence_s = 0.0",
           ("tests/daemon/test_server.py::test_dead_writer_pending_store_is_released_after"
            "_lease",)),
    # A lower tier's copy is checked before it is promoted into the pool.
    Mutant("a disk block's data checksum ignored", "daemon/tiers/disk/files.py",
           "    if zlib.crc32(buf) != dcrc:", "    if False:",
           ("tests/daemon/tiers/test_disk.py::test_corrupt_file_is_a_counted_miss",)),
    Mutant("a disk block file under another key's name loaded", "daemon/tiers/disk/files.py",
           "    if key is not None and fkey != key:", "    if False:",
           ("tests/daemon/tiers/test_disk.py::test_a_file_in_another_keys_place_is_a_counted"
            "_miss",)),
    Mutant("another namespace's disk block file loaded", "daemon/tiers/disk/files.py",
           '        raise CorruptBlock("namespace hash mismatch")', "        pass",
           ("tests/daemon/tiers/test_disk.py::test_another_namespaces_file_is_a_counted_miss",)),
    # A warm restart trusts a journaled block only if its slot still holds its bytes.
    Mutant("a restored block's slot checksum ignored", "daemon/state/snapshot.py",
           "        if crc == e.crc:", "        if True:",
           ("tests/daemon/state/test_journal.py::test_validation_discards_bad_slots",)),
    Mutant("a restart restores two keys into one slot", "daemon/state/snapshot.py",
           "        elif not 0 <= e.slot < pool.num_slots or e.slot in seen:",
           "        elif not 0 <= e.slot < pool.num_slots:",
           ("tests/daemon/state/test_journal.py::test_validation_trusts_no_slot_twice_and_no"
            "_other_slot_size",)),
    Mutant("a restart trusts a journal of another slot size", "daemon/state/snapshot.py",
           "    if state.slot_bytes != pool.slot_bytes:", "    if False:",
           ("tests/daemon/state/test_journal.py::test_validation_trusts_no_slot_twice_and_no"
            "_other_slot_size",)),
    Mutant("a checksum journaled for a slot dropped while it was read", "daemon/state/journal.py",
           "                if self._gen.get(slot, 0) != gen:", "                if False:",
           ("tests/daemon/state/test_journal.py::test_checksum_voided_when_slot_dropped"
            "_meanwhile",)),
    Mutant("a Mooncake value's checksum ignored", "daemon/tiers/mooncake/values.py",
           "            or zlib.crc32(body) != crc):", "            or False):",
           ("tests/daemon/tiers/test_mooncake.py::test_value_format_round_trip_and_checks",)),
    Mutant("a worker keeps its mapping of a pool file the daemon replaced",
           "connector/transfer/pool_map.py",
           "            return self.wait_ready().same_file(path, size)", "            return True",
           (VLLM + "test_worker.py::test_pool_mapped_at_creation_and_kept_across_restart",)),
    # Not bytes but loads: the daemon frees a retired slot only past every busy reader.
    Mutant("a step's index read never marked busy in its reader record", "connector/session.py",
           "        record.write(True, view.applied, self._sent)  # busy from before the read on\n",
           "        record.write(False, view.applied, self._sent)  # busy from before the read on\n",
           ("tests/connector/test_session.py",),
           more=(("connector/session.py",
                  "        if view.refresh():  # the record holds the epoch read past: only a move"
                  " needs it\n            record.write(True, view.applied, self._sent)",
                  "        if view.refresh():  # the record holds the epoch read past: only a move"
                  " needs it\n            record.write(False, view.applied, self._sent)"),)),
    Mutant("a message mid-step ends the step's busy mark", "connector/session.py",
           "        busy = self._busy and not end_of_step", "        busy = False",
           ("tests/connector/test_session.py",)),
    Mutant("a few records' refresh takes another namespace's entries", "connector/view_few.py",
           "            if ens == ns and lo <= state <= hi and keylen > 0:",
           "            if lo <= state <= hi and keylen > 0:",
           ("tests/connector/test_view_few.py::test_entry_by_entry_refreshes_leave_the_view_as"
            "_the_loop_does",)),
    Mutant("a refresh takes another namespace's entries", "connector/index_view.py",
           'return (rows["ns"] == self.namespace) & (rows["state"] >= si.PENDING)',
           'return (rows["state"] >= si.PENDING)',
           ("tests/connector/test_index_view.py::test_after_every_budgeted_refresh_nothing_held"
            "_is_stale",)),
    # Not bytes but who may reach them: the pool and index files are the daemon's alone.
    Mutant("a pool file with another hard link reused", "daemon/store/private_files.py",
           "        elif st.st_nlink != 1:", "        elif False:",
           ("tests/daemon/test_pool_files.py::test_a_pool_file_with_another_name_is_refused",)),
    Mutant("a symlink at the index path followed", "daemon/store/private_files.py",
           "    if stat.S_ISLNK(st.st_mode):\n        raise PrivateFileError(f\"{setting} {path}: "
           "the {what} is a symlink; refusing to follow \"",
           "    if False:\n        raise PrivateFileError(f\"{setting} {path}: "
           "the {what} is a symlink; refusing to follow \"",
           ("tests/daemon/test_pool_files.py::test_a_planted_index_file_stops_the_start_and_is"
            "_left_alone[symlink]",)),
    Mutant("a pool file another user created reused", "daemon/store/private_files.py",
           "        elif st.st_uid != os.geteuid():", "        elif False:",
           ("tests/daemon/test_startup.py::test_pool_file_another_user_created_is_refused",)),
    Mutant("a file without kvoffload's mark taken for ours", "daemon/store/private_files.py",
           "    if has_mark(fd, kind) or (legacy is not None and legacy(fd, os.fstat(fd))):\n"
           "        return",
           "    return",
           ("tests/daemon/test_pool_files.py::test_a_planted_index_file_stops_the_start_and_is"
            "_left_alone[unmarked]",)),
    Mutant("a namespace reset without the sole client's or the operator's right",
           "daemon/control/service.py",
           '        if msg.scope == "namespace" or client.owner == 0:', "        if False:",
           ("tests/daemon/control/test_quotas.py::test_namespace_reset_needs_sole_client_or"
            "_operator_credential",)),
    Mutant("pinned blocks evicted", "daemon/store/index.py",
           "return self.state[slot] == SlotState.READY and self.pins[slot] == 0",
           "return self.state[slot] == SlotState.READY",
           ("tests/daemon/store/test_index.py::test_states_and_eviction_order",)),
    # The copy engine checks a job whole before any byte moves.
    Mutant("a job's rows outside the pool or the KV tensors copied", "connector/transfer/engine.py",
           "if bool((arr < 0).any()) or bool((arr >= bounds).any()):", "if False:",
           ("tests/connector/transfer/test_engine.py::test_bad_job_is_reported_and_corrupts"
            "_nothing",)),
    Mutant("a job writing one destination twice copied", "connector/transfer/engine.py",
           "if bool((ordered[1:] == ordered[:-1]).any()):", "if False:",
           ("tests/connector/transfer/test_engine.py::test_duplicate_destinations_rejected",)),
    Mutant("a superseded index passes the worker's checks", "connector/index_map.py",
           "if self.superseded() or not ok.any():", "if not ok.any():",
           (VLLM + "test_plugin.py::test_worker_rank_pages_generations_and_failed_loads",)),
    Mutant("KV dtype dropped from the namespace", "connector/vllm/geometry.py",
           "identity = repr((config.model.name, config.model.dtype, par.world_size,",
           "identity = repr((config.model.name, par.world_size,",
           (VLLM + "test_namespace.py::test_engines_differing_only_in_kv_cache_dtype_do_not"
            "_share",),
           more=(("connector/vllm/geometry.py",
                  'name = (f"{config.model.name}|{config.model.dtype}|tp',
                  'name = (f"{config.model.name}|tp'),
                 ("connector/vllm/geometry.py", '_CACHE_FIELDS = ("cache_dtype", ',
                  "_CACHE_FIELDS = (")),),
    # Earmarked reservations (daemon/store/earmarks.py, connector/vllm/parked.py).
    Mutant("an earmark handed over before readers are past its block", "daemon/store/earmarks.py",
           "        if self.reclaimer.readers:\n", "        if False:\n",
           (EARMARKS + "test_a_claim_evicts_the_block_and_hands_over_only_after_readers",)),
    Mutant("a burnt grant lands on the granted generation", "daemon/store/earmarks.py",
           "self.gen[slot] = (self.gen[slot] + 2) & si.GEN_MASK",
           "self.gen[slot] = (self.gen[slot] + 1) & si.GEN_MASK",
           (EARMARKS + "test_earmarks_handed_back_or_revoked_are_burnt_their_blocks_kept",
            "tests/daemon/control/test_step_earmarks.py::test_a_lapsed_engines_unclaimed"
            "_earmarks_are_burnt")),
    Mutant("a handover past its deadline", "daemon/store/earmarks.py",
           "        if time.monotonic() > h.deadline:", "        if False:",
           (EARMARKS + "test_reclaimed_past_the_deadline_is_burnt_not_handed_over",)),
    Mutant("a claim past its deadline accepted", "daemon/store/earmarks.py",
           "late = now > start + si.HANDOVER_S", "late = False",
           (EARMARKS + "test_a_claim_arriving_past_its_deadline_is_refused_and_burnt",)),
    Mutant("late handovers not burnt while readers hold them", "daemon/store/earmarks.py",
           "late = [s for s, h in self.handovers.items() if now > h.deadline]", "late = []",
           (EARMARKS + "test_past_its_deadline_a_handover_is_burnt",)),
    Mutant("another engine's earmark claimed", "daemon/store/earmarks.py",
           "if self.earmarks.get(slot) is not holder or gen !=", "if gen !=",
           (EARMARKS + "test_another_holder_or_generation_is_refused_and_changes_nothing",)),
    Mutant("a loaded earmark stays earmarked", "daemon/store/index.py",
           "        if slot in self.earmarks:  # a load of it: not evicted while in use\n",
           "        if False:\n",
           (EARMARKS + "test_a_load_of_an_earmarked_block_withdraws_it_and_burns_after_the"
            "_load",)),
    Mutant("a reused earmark stays earmarked", "daemon/store/index.py",
           "        if slot in self.earmarks:  # reused: kept", "        if False:  # reused: kept",
           (EARMARKS + "test_a_touch_withdraws_an_earmark_and_burns_it_at_once",)),
    Mutant("earmarked blocks droppable", "daemon/store/index.py",
           "            and slot not in self.earmarks\n", "\n",
           (EARMARKS + "test_earmarks_are_neither_dropped_nor_reset_and_count_as_reserved",),
           more=(("daemon/store/index.py",
                  "return self.state[slot] == SlotState.READY and self.pins[slot] == 0 \\",
                  "return self.state[slot] == SlotState.READY and self.pins[slot] == 0"),)),
    Mutant("an abort before the handover frees the slot", "daemon/store/index.py",
           "        if self.cancel_handover(slot):  # not handed over yet",
           "        if False:  # not handed over yet",
           (EARMARKS + "test_an_abort_before_the_handover_burns_and_keeps_the_slot_retired",)),
    Mutant("the worker's handover wait off by one", "connector/index_map.py",
           "- np.uint64(1)) & _MASK", "- np.uint64(0)) & _MASK",
           (VLLM + "test_worker_handover.py::test_a_store_not_handed_over_is_parked_until"
            "_the_handover",)),
    Mutant("the worker waits past its deadline", "connector/vllm/worker.py",
           "if time.monotonic() < stamp + HANDOVER_WAIT_S:", "if True:",
           (VLLM + "test_worker_handover.py::test_a_store_past_its_deadline_is_given_up_for"
            "_good",)),
]
