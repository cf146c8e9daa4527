"""The bugs tests/mutants.py plants, one at a time, each in a scratch copy of the
repository: per mutant, the file, the exact snippet it replaces (it must occur once: a
snippet that no longer exists is reported as stale) and the CI tests meant to catch it
(specific node ids, so each mutant's run stays short). Not a test module: pytest does not
collect it. docs/mutants.md has the last run's table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (or files) expected to catch it; all run in CI


EQUIVALENCE = ("tests/test_equivalence.py::test_layouts_match_single_process",)
AGAINST_TORCH = ("tests/test_equivalence.py::test_clipped_update_equals_torch_one_process",
                 "tests/test_equivalence.py::test_clipped_update_equals_torch_sharded")
STEP = (*EQUIVALENCE, *AGAINST_TORCH)  # layouts against one process, and the update against torch

# The data-side switches alone against their definitions (tests/test_document_switches.py),
# and the index arithmetic against loops over tokens (tests/test_index_properties.py).
SWITCHES = "tests/test_document_switches.py::"
EOD_ALONE = SWITCHES + "test_eod_mask_loss_alone_is_the_mean_over_targets_not_after_an_eod"
MASK_ALONE = SWITCHES + "test_document_mask_alone_is_each_document_run_alone"
RESET_ALONE = SWITCHES + "test_reset_positions_alone_is_the_row_at_positions_restarting_at_each_document"
DATA_MASK_ALONE = SWITCHES + "test_the_datas_loss_mask_alone_is_the_mean_over_the_targets_the_file_keeps"
STEP_TIME = "tests/test_step_time.py"
STEP_DRIFT = "tests/test_step_time_drift.py"
HARDWARE = "tests/test_hardware.py"
BY_LOOP = "tests/test_index_properties.py::test_segments_positions_and_eod_masks_match_a_loop_over_tokens"
WINDOW = "tests/test_index_properties.py::test_the_window_attends_exactly_each_querys_document"
FIT_MASKED = "tests/test_loss_masks.py::test_fit_loss_is_the_mean_over_the_unmasked_targets_and_resumes_exactly"
CP4_DOCUMENTS = "tests/test_documents_layouts.py::test_packed_documents_on_each_layout_equal_one_process[4]"
SPLIT_DTENSOR = "tests/test_split_backward.py::test_the_halves_equal_eager_with_a_dtensor_stage_input"
SPLIT_HALVES = "tests/test_split_backward.py::test_the_halves_split_the_work_and_equal_eager[aot_eager-none]"
SIGNAL_ONE_RANK = "tests/test_stop_signals.py::test_a_signal_to_one_rank_stops_every_rank_and_rank_0_names_it"
ASYNC = "tests/test_async_checkpoint.py::"
STEP_PEAK = "tests/test_bench_step_peak.py::test_planned_peak_follows_the_measured_step"
# The runtime switches alone (tests/test_runtime_switches.py): the traffic cases share one
# 2-rank launch (every case runs whichever node id is chosen); fp8 and MoE are one process.
RUNTIME = "tests/test_runtime_switches.py::"
TRAFFIC = RUNTIME + "test_traffic_switch_alone_equals_one_process"
FP8_GEMMS = RUNTIME + "test_fp8_gemms_equal_dequantised_fp32_matmuls"
FP8_STEP = RUNTIME + "test_fp8_step_equals_by_hand_dequantised_gemms"
MOE_BALANCE = RUNTIME + "test_moe_balance_mode_equals_by_hand"
LAYER_MEMORY = "tests/test_bench_layer_memory.py::test_a_layer_keeps_what_the_planner_and_the_textbook_say"
SECOND_BACKWARD = "tests/test_policies.py::test_selective_checkpointing_serves_a_second_backward_when_asked[True]"
KEPT_PIPELINES = "tests/test_pipeline_exec.py::test_pipeline_equals_one_process[4]"  # its *_kept cases
ZERO = "tests/test_zero.py::"

MUTANTS = [
    # --- the first nine: the gradient path, clipping, the norm, the loss scale, export ---
    Mutant("grad_1d_x0.5", "every 1-D (norm) gradient halved in the sharded backward (the buckets' reduction)",
           "meshtrain/parallel/bucket_run.py",
           "        return grad._local_tensor, tuple(grad.placements)\n",
           "        return grad._local_tensor * (0.5 if grad.ndim == 1 else 1.0), tuple(grad.placements)\n",
           STEP),
    Mutant("grad_1d_x2", "every 1-D (norm) gradient doubled in the sharded backward (the buckets' reduction)",
           "meshtrain/parallel/bucket_run.py",
           "        return grad._local_tensor, tuple(grad.placements)\n",
           "        return grad._local_tensor * (2.0 if grad.ndim == 1 else 1.0), tuple(grad.placements)\n",
           STEP),
    Mutant("clip_off", "gradient clipping removed", "meshtrain/train/optim.py",
           "        if clip is not None:\n", "        if False:\n", STEP),
    Mutant("clip_off_sharded", "gradient clipping removed when the parameters are sharded",
           "meshtrain/train/optim.py",
           "norm, grad_clip)",
           "norm, None if type(state.params[names[0]]).__name__ == 'DTensor' else grad_clip)", STEP),
    Mutant("norm_no_all_reduce", "the gradient norm without its all-reduce over the world",
           "meshtrain/train/optim.py",
           "    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:\n",
           "    if False:\n", STEP),
    Mutant("no_dp_reduction", "gradients not reduced over the replicated (dp) axis",
           "meshtrain/parallel/param_gather.py",
           "        return grad.redistribute(grad.device_mesh, ctx.placements), None, None\n",
           "        return DTensor.from_local(grad.to_local(), grad.device_mesh, ctx.placements, run_check=False), "
           "None, None\n", (*STEP, TRAFFIC + "[dp2_bucket_param]")),  # buckets (the default) reduce elsewhere
    Mutant("bucket_all_reduce_avg", "the buckets' gradient all-reduce over dp averages instead of summing",
           "meshtrain/parallel/bucket_run.py",
           'flat = funcol.all_reduce(flat, "sum", self.groups.name(group))',
           'flat = funcol.all_reduce(flat, "avg", self.groups.name(group))', STEP),
    Mutant("loss_per_micro_batch", "the loss averaged per micro-batch instead of over the global batch",
           "meshtrain/train/step.py",
           "                loss = lm / n_tokens\n",
           "                loss = lm / count_targets([targets[micro]])\n", STEP),
    Mutant("decay_on_norms", "weight decay applied to 1-D parameters (norm scales, biases)",
           "meshtrain/train/optim.py",
           "        return ndim >= 2 and not any(",
           "        return ndim >= 0 and not any(", STEP),
    Mutant("export_rope_theta", "RoPE theta doubled in the exported config.json", "meshtrain/models/llama/hf.py",
           '"rope_theta": float(cfg.rope_theta)',
           '"rope_theta": 2 * float(cfg.rope_theta)', ("tests/test_hf.py",)),

    # --- the three document keys (data.document_mask, data.reset_positions, data.eod_mask_loss) ---
    Mutant("eod_mask_needs_document_mask",
           "data.eod_mask_loss masks only when data.document_mask is on too (issue 40's survivor)",
           "meshtrain/run/fit.py",
           '("eod_mask_loss", d.eod_mask_loss),',
           '("eod_mask_loss", d.eod_mask_loss and d.document_mask),', (EOD_ALONE,)),
    Mutant("reset_positions_needs_document_mask",
           "data.reset_positions restarts positions only when data.document_mask is on too",
           "meshtrain/run/fit.py",
           '("positions", d.reset_positions),',
           '("positions", d.reset_positions and d.document_mask),',
           (RESET_ALONE + "[gpt2]", RESET_ALONE + "[llama]")),
    Mutant("eod_mask_on_eod_targets",
           "eod_mask_loss ignores the targets that are an EOD instead of the targets after one",
           "meshtrain/data/documents.py",
           "torch.where(tokens == eod, torch.full_like(targets, -1), targets)",
           "torch.where(targets == eod, torch.full_like(targets, -1), targets)", (BY_LOOP, EOD_ALONE)),
    Mutant("segments_eod_opens_next",
           "document segments: an EOD counted in the next document instead of the one it ends",
           "meshtrain/data/documents.py",
           "    return is_eod.cumsum(-1) - is_eod\n",
           "    return is_eod.cumsum(-1)\n", (BY_LOOP, MASK_ALONE + "[llama]")),
    Mutant("positions_restart_at_eod",
           "reset_positions restarts at each EOD instead of at the token after it",
           "meshtrain/data/documents.py",
           "    starts[..., 1:] = tokens[..., :-1] == eod\n",
           "    starts[..., 1:] = tokens[..., 1:] == eod\n", (BY_LOOP, RESET_ALONE + "[gpt2]")),
    Mutant("document_mask_sees_earlier_documents",
           "document_mask: a query also sees the keys of the earlier documents of its row (plain causal)",
           "meshtrain/models/attention.py",
           "(q_seg[:, :, None] == k_seg[:, None, :])",
           "(q_seg[:, :, None] >= k_seg[:, None, :])",
           ("tests/test_index_properties.py::test_each_eager_tile_attends_exactly_its_queries_documents",
            MASK_ALONE + "[gpt2]")),
    # The compiled document attention's window (issue 40's other survivor's class).
    Mutant("window_one_key_short",
           "compiled document attention: the span from each tile's last query (not one past it), one key short",
           "meshtrain/models/attention.py",
           "torch.arange(tile, seq + 1, tile, device=segments.device)",
           "torch.arange(tile - 1, seq, tile, device=segments.device)", (WINDOW,)),
    Mutant("window_one_power_short",
           "compiled document attention: the window one power of two short for a span up to a tile past tile x 2^j",
           "meshtrain/models/attention.py",
           "    while window < span:\n",
           "    while window + tile < span:\n", (WINDOW,)),

    # --- the data's loss masks (<prefix>.loss_mask.bin) ---
    Mutant("loss_mask_of_inputs", "the data's loss mask applied by the inputs' bytes, not the targets'",
           "meshtrain/run/rows.py",
           'torch.where(mask[:, 1:], out["targets"], -1)',
           'torch.where(mask[:, :-1], out["targets"], -1)', (DATA_MASK_ALONE, FIT_MASKED)),
    Mutant("loss_mask_counts_every_target",
           "with a loss mask (eod_mask_loss off) the loss divided by every target, masked ones included",
           "meshtrain/run/fit.py",
           "        if not (d.eod_mask_loss or self.data.loss_mask):",
           "        if not d.eod_mask_loss:", (DATA_MASK_ALONE, FIT_MASKED)),
    Mutant("loss_mask_unshuffled",
           "the training split's loss masks read at the sample positions, not through the epoch shuffle",
           "meshtrain/data/dataset.py",
           'None when no dataset has one."""\n        return _gather(self.parts, self._locate(start, count), True)',
           'None when no dataset has one."""\n        return _gather(self.parts, (np.zeros(count, dtype=np.int64), '
           'np.arange(start, start + count)), True)', (DATA_MASK_ALONE,)),

    # --- context-parallel documents at cp 4 (a ring walked the wrong way is right at cp 2) ---
    Mutant("cp_ring_segments_forward",
           "cp ring forward: the document ids of block r + i matched to the keys of block r - i",
           "meshtrain/parallel/cp_exchanges.py",
           "out, lse, segs[(r - i) % cp])",
           "out, lse, segs[(r + i) % cp])", (CP4_DOCUMENTS,)),
    Mutant("cp_ring_segments_backward",
           "cp ring backward: the document ids of block r + i matched to the keys of block r - i",
           "meshtrain/parallel/cp_exchanges.py",
           "dq, dkv,\n                         segs[(r - i) % cp])",
           "dq, dkv,\n                         segs[(r + i) % cp])", (CP4_DOCUMENTS,)),

    # --- the zero-bubble split backward of a compiled stage ---
    Mutant("split_dtensor_input_not_unwrapped",
           "split backward: a DTensor gradient's descriptor not unwrapped (the stage input's taken for a weight's)",
           "meshtrain/train/split_backward.py",
           '    while hasattr(desc, "base"):  # a subclass',
           '    while False:  # a subclass', (SPLIT_DTENSOR,)),
    Mutant("split_weight_half_misses_inputs",
           "split backward: the input half keeps for the weight half only its own values, not the graph inputs",
           "meshtrain/train/split_backward.py",
           "            split.kept[split.key] = passed + list(kept)\n",
           "            split.kept[split.key] = list(kept)\n", (SPLIT_HALVES,)),

    # --- the stop agreement (run/fit.py _stop_agreed) ---
    Mutant("stop_min", "stop agreement: the ranks' signals reduced by MIN, not MAX",
           "meshtrain/run/fit.py",
           "        dist.all_reduce(number, dist.ReduceOp.MAX)\n",
           "        dist.all_reduce(number, dist.ReduceOp.MIN)\n", (SIGNAL_ONE_RANK,)),
    Mutant("stop_which_signal_lost",
           "stop agreement: the all-reduce carries whether a signal came, not which (rank 0 names SIGHUP)",
           "meshtrain/run/fit.py",
           "float(signal.Signals[name].value if name else 0)",
           "float(1 if name else 0)", (SIGNAL_ONE_RANK,)),
    Mutant("stop_writing_flag_local",
           "stop agreement: a background save taken as finished everywhere when this rank's has",
           "meshtrain/run/fit.py",
           "        self.saves.finished_everywhere = not number[1].item()\n",
           "        self.saves.finished_everywhere = not writing\n",
           (ASYNC + "test_every_rank_joins_a_background_write_at_the_same_step",)),

    # --- async save (checkpoint.async_save) ---
    Mutant("async_no_staging_copy", "async save: the staging copy skipped, the writer reads the live tensors",
           "meshtrain/checkpoint/background.py",
           "                buf.copy_(local, non_blocking=local.is_cuda)\n",
           "                buf = local\n",
           (ASYNC + "test_the_checkpoint_holds_the_step_that_saved_and_is_latest_only_once_committed",)),
    Mutant("async_next_save_does_not_wait",
           "async save: the next save begins without joining the one in flight (two writes, commits out of order)",
           "meshtrain/checkpoint/background.py",
           "        self.wait()\n        pending = begin(",
           "        pending = begin(", (ASYNC + "test_one_save_in_flight_the_next_waits_for_it",)),

    # --- buckets, prefetch, reshard_after_forward, fsdp_accumulate (parallel/bucket_run.py, regather.py, bound_params.py, context.py) ---
    Mutant("regather_ahead_wrong_shards",
           "backward's gather issued ahead for the next bucket backward needs, made from this bucket's shards",
           "meshtrain/parallel/regather.py",
           "saved[ahead])))}",
           "saved[b])))}", (TRAFFIC + "[fsdp2_prefetch3]",)),
    Mutant("prefetch_one_short", "forward issues parallel.prefetch - 1 buckets ahead (none at the default 1)",
           "meshtrain/parallel/bound_params.py",
           "for nb in range(b + 1, b + 1 + context.prefetch):",
           "for nb in range(b + 1, b + context.prefetch):",
           ("tests/test_overlap.py::test_eager_gathers_overlap_the_previous_block[1]",)),
    Mutant("reshard_ignored", "parallel.reshard_after_forward false ignored: backward gathers again anyway",
           "meshtrain/parallel/context.py",
           "self.prefetch, self.reshard = traffic.prefetch, traffic.reshard_after_forward or held",
           "self.prefetch, self.reshard = traffic.prefetch, True",
           ("tests/test_comms_estimate.py::test_estimate_follows_resharding_and_prefetch[block-kept]",)),
    Mutant("held_partials_dropped",
           "the partial sums held over earlier micro-steps (dp's no_sync) not added into the last reduction",
           "meshtrain/parallel/bucket_run.py",
           "held = leaves[j].grad if self._held else None",
           "held = None", (TRAFFIC + "[dp2_prefetch0]",)),
    Mutant("unsharded_accumulation_dropped",
           "parallel.fsdp_accumulate unsharded: the earlier micro-steps' packed gradients dropped, not added",
           "meshtrain/parallel/bucket_run.py",
           "                buf += self._packed.pop(k)\n",
           "                self._packed.pop(k)\n",
           ("tests/test_equivalence.py::test_unsharded_accumulation_matches_single_process[eager]",)),

    # --- parallel.pp_keep_gathered (parallel/keep_gathered.py) ---
    Mutant("kept_grads_layout_of_leaf",
           "keep-gathered: the summed gradients wrapped in the gathered leaf's placements, not their partial layout",
           "meshtrain/parallel/keep_gathered.py",
           "self._layouts[n], run_check=False",
           "s[1].placements, run_check=False", (KEPT_PIPELINES,)),
    Mutant("kept_sums_in_compute_dtype",
           "keep-gathered: the kept bf16 weights' gradients summed in bf16, not in fp32 (main_grad)",
           "meshtrain/parallel/keep_gathered.py",
           "self._main[name] = (g.float() if have is None",
           "self._main[name] = (g.clone() if have is None", (ZERO + "test_zero_1_and_2_equal_one_process[2]",)),

    # --- parallel.zero 1 and 2 (parallel/gradient_schedule.py) ---
    Mutant("zero_reduces_twice",
           "zero 1/2: the step's own replica reductions also run on the last micro-batch, then the release's",
           "meshtrain/parallel/gradient_schedule.py",
           "        elif self.ctx is not None and hasattr(self.ctx, \"hold_reductions\"):",
           "        if self.ctx is not None and hasattr(self.ctx, \"hold_reductions\"):",
           (ZERO + "test_zero_1_and_2_equal_one_process[2]",)),
    Mutant("zero_reduces_after_backward", "zero 1/2: no bucket reduced inside backward, all after it (no overlap)",
           "meshtrain/parallel/gradient_schedule.py",
           "self.kept.arm(self.per_micro_batch or micro == last)",
           "self.kept.arm(False)",
           (ZERO + "test_an_eager_step_overlaps_gathers_with_forward_and_reductions_with_backward[1]",)),
    Mutant("zero2_reduces_once", "zero 2 reduces once per step, as zero 1",
           "meshtrain/parallel/gradient_schedule.py",
           "self.per_micro_batch = kept is not None and traffic.zero == 2",
           "self.per_micro_batch = False", (ZERO + "test_recorded_collectives_are_the_planners[fsdp2-2]",)),
    # --- fp16 (train/loss_scale.py, train/scaled_step.py) ---
    Mutant("fp16_not_unscaled", "fp16: the gradients reach the norm and the update still scaled",
           "meshtrain/train/scaled_step.py",
           "    torch._foreach_mul_(grads, 1.0 / state.loss_scale.scale)\n",
           "    pass\n", ("tests/test_fp16.py::test_30_fp16_steps_track_fp32_within_bf16_tolerance",)),
    Mutant("fp16_no_backoff", "fp16: an overflow skips the step but leaves the scale",
           "meshtrain/train/loss_scale.py",
           "self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)",
           "self.scale = self.scale",
           ("tests/test_fp16.py::test_an_overflow_on_one_rank_skips_the_step_on_every_rank_and_backs_off",)),

    # --- fp8 recipes (models/fp8.py) ---
    Mutant("fp8_grad_e4m3", "fp8: the gradients quantised to e4m3 (the forward's format), not e5m2",
           "meshtrain/models/fp8.py",
           "GRAD_DTYPE = torch.float8_e5m2",
           "GRAD_DTYPE = torch.float8_e4m3fn", (FP8_GEMMS + "[tensorwise-dtype0]",)),
    Mutant("fp8_recipes_swapped", "fp8: tensorwise takes rowwise amaxes and rowwise one amax per tensor",
           "meshtrain/models/fp8.py",
           'over = (0, 1) if recipe == "tensorwise" else (dim,)',
           'over = (dim,) if recipe == "tensorwise" else (0, 1)', (FP8_GEMMS + "[tensorwise-dtype0]",)),
    Mutant("fp8_rowwise_grad_x_wrong_dim",
           "fp8 rowwise: grad_x's weight scaled along the forward's contracted dim (K), not N",
           "meshtrain/models/fp8.py",
           '_quantize(w, FWD_DTYPE, "w", 0, recipe, allmax)',
           '_quantize(w, FWD_DTYPE, "w", 1, recipe, allmax)', (FP8_GEMMS + "[rowwise-dtype0]",)),

    # --- activation checkpointing modes (models/policy.py) ---
    Mutant("selective_recomputes_cpu_attention",
           "selective checkpointing: the CPU attention kernel missing from the ops it keeps (recomputed)",
           "meshtrain/models/policy.py",
           "                   _aten._scaled_dot_product_flash_attention_for_cpu.default,\n",
           "", (LAYER_MEMORY,)),
    Mutant("selective_saves_the_cheap_ops", "selective checkpointing: keeps the cheap ops, recomputes the matmuls",
           "meshtrain/models/policy.py",
           "CheckpointPolicy.MUST_SAVE if expensive else CheckpointPolicy.PREFER_RECOMPUTE",
           "CheckpointPolicy.PREFER_RECOMPUTE if expensive else CheckpointPolicy.MUST_SAVE", (LAYER_MEMORY,)),
    Mutant("selective_second_backward_unserved",
           "selective checkpointing under zero-bubble: saved outputs consumed by the first backward",
           "meshtrain/models/policy.py",
           "contexts = _reusable_contexts if self.backward_twice else create_selective_checkpoint_contexts",
           "contexts = create_selective_checkpoint_contexts", (SECOND_BACKWARD,)),

    # --- MoE balance modes (models/moe.py) ---
    Mutant("moe_aux_without_top_k", "MoE aux: the balance loss without its 1/k (f_i as slots over S, not kS)",
           "meshtrain/models/moe.py",
           "cfg.aux_coef * cfg.num_experts / (cfg.top_k * seq_len * seq_len)",
           "cfg.aux_coef * cfg.num_experts / (seq_len * seq_len)", (MOE_BALANCE + "[aux]",)),
    Mutant("moe_bias_update_sign", "MoE aux_free: the bias raised for experts above the mean load",
           "meshtrain/models/moe.py",
           "torch.sign(load.float().mean() - load.float())",
           "torch.sign(load.float() - load.float().mean())", (MOE_BALANCE + "[aux_free]",)),
    Mutant("moe_bias_in_gates", "MoE aux_free: the bias added into the gates, not only the choice of experts",
           "meshtrain/models/moe.py",
           "    gates = scores.gather(-1, idx)\n",
           "    gates = choice.gather(-1, idx)\n", (MOE_BALANCE + "[aux_free]",)),

    # --- the planner's peak (estimate/bucket_memory.py, estimate/memory.py) ---
    Mutant("peak_prefetch_regather_dropped",
           "planner: backward's gathers issued ahead (prefetch) left out of a bucket's transient",
           "meshtrain/estimate/bucket_memory.py",
           "comm += prefetch * self.copies + self.gathered",
           "comm += self.gathered", (STEP_PEAK,)),
    Mutant("peak_reductions_in_flight_dropped",
           "planner: one reduce-scatter output in flight counted, not prefetch + 1",
           "meshtrain/estimate/bucket_memory.py",
           "(prefetch + 1) * self.gathered // self.ways",
           "self.gathered // self.ways", (STEP_PEAK,)),
    Mutant("peak_grads_dropped", "planner: the gradients left out of the step's working set",
           "meshtrain/estimate/memory.py",
           'm["grads"] + working)',
           'working)', (STEP_PEAK,)),

    # --- the step-time model (estimate/step_work.py, comm_time.py, step_time.py) ---
    Mutant("time_prefetch_hides_nothing", "step time: parameter gathers and reductions waited for whatever the prefetch",
           "meshtrain/estimate/comm_time.py",
           "hide, share = buckets > 0 and traffic.prefetch > 0, clock.hw.comm_overlap",
           "hide, share = False, clock.hw.comm_overlap", (STEP_TIME,)),
    Mutant("time_full_recompute_attention_once_more_divided",
           "step time: full checkpointing recomputes a ninth of the blocks' attention, not its forward third",
           "meshtrain/estimate/step_time.py",
           "matmul_fwd=blocks.matmul_fwd, attention=blocks.attention,",
           "matmul_fwd=blocks.matmul_fwd, attention=blocks.attention / 3,", (STEP_TIME,)),
    Mutant("time_weight_gradients_free", "step time: the weight-gradient GEMMs of backward cost nothing",
           "meshtrain/estimate/step_work.py",
           "wgrad = mm(n, k, m, dtype) if trainable else 0.0",
           "wgrad = 0.0", (STEP_TIME,)),
    Mutant("time_overlap_share_ignored", "step time: compute beside a collective hides all of it, whatever the "
           "hardware's comm_overlap", "meshtrain/estimate/comm_time.py",
           "+ (1.0 - share) * min(comm, compute)", "+ 0.0 * min(comm, compute)", (STEP_TIME,)),
    Mutant("time_drift_where_issued_ahead", "step time: the ranks' drift counted at parameter collectives issued "
           "a bucket ahead of their wait (prefetch), as if waited as issued", "meshtrain/estimate/step_time.py",
           "return (buckets > 0 and traffic.prefetch > 0) or traffic.keep_gathered",
           "return traffic.keep_gathered", (STEP_DRIFT,)),
    Mutant("time_collective_table_ignored", "hardware: a calibrated collective table left unread (the ring "
           "formula instead)", "meshtrain/estimate/hardware.py",
           'if table and table["ranks"] == (2 if op == "send_recv" else group_size) and not spans_nodes:',
           'if False:', (HARDWARE,)),
]

# Realistic bugs no CI test catches yet (docs/mutants.md, "Known survivors"): not in the
# default run; `python tests/mutants.py --only NAME` plants one and runs the tests that
# were expected to catch it (it is reported as survived until a test sees its class).
KNOWN_SURVIVORS: list[Mutant] = []
