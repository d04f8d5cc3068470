"""Distill stage: train a student to match the teacher (the original source model) on calibration text.

Losses (weights and temperature from the recipe):
- output: causal LMs, KL(teacher || student) of the softened next-token distributions, times T^2
  (Hinton et al. 2015: keeps gradient scale independent of T); sentence encoders, 1 - cosine of
  the pooled sentence embeddings (the task's own output);
- hidden: MSE between student hidden states and the teacher layers they replace, divided by the
  teacher's mean square so every layer weighs alike whatever its scale. Student layer j maps to
  the teacher layer the prune stage kept at position j (uniform spacing otherwise); the student's
  last layer always maps to the teacher's last. `hidden_layers: last` compares only that pair.

The learning rate is constant or warms up and decays to zero (cosine or linear) over the run,
whose length is whichever bound, steps or seconds, comes first.

The student is what the prune stage produced, or (no prune stage) `student_layers` of the
teacher's layers, evenly spaced. Training is bounded by max_steps and max_seconds, shows a
progress bar, saves a loss curve PNG into the artifact, and checkpoints under
$OPTIMIZE_CACHE/distill/<key>/ (key: source hash, prune + distill config, calibration hash) so an
interrupted run resumes where it stopped.

Example recipe:

    distill:
      method: logit_hidden_kd
      params: {max_steps: 300, max_seconds: 480, batch_size: 16, seq_len: 128, lr: 1e-4}

Modules: logit_hidden_kd (the method), config (its parameters), student (the student and its layer
map), data (training batches), objectives (the losses), training (the loop, checkpoints, loss curve).
"""
