"""The training loop and what one step does: ``loop`` (the loop on one screen), ``stepping`` (one optimizer step: step
policy, pipelines that run it), ``loss_scale`` (fp16 loss scaling in that step), ``pipeline`` (which pipeline),
``batch_checks`` (the tasks' label checks, on the host as batches are read), ``evaluation``, ``precision``, ``ema``, ``stopping``, ``signals``, ``profiling``, ``throughput``, ``summaries`` (gradient
norms, embedding row norms, lrs, histograms every ``train.summary_every_steps``). May import ``tracking``, ``checkpoint``
and the component rooms; never ``config``, ``build`` or an entry point.
"""
