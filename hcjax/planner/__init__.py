"""The planner as a library: `plan(PlanConfig(...))` compiles a job's train and decode steps for
a TPU topology on any host and reports memory, FLOPs, collectives and time estimates. Modules:
`tpu` (libtpu's compile-only devices), `hlo` (reading compiled HLO text), `cost` (the cost
model: model FLOPs, roofline bound and estimate, KV fit), `compile_steps` (abstract inputs,
compile, measure). It allocates nothing on any device."""

from hcjax.planner.compile_steps import PlanConfig, plan

__all__ = ["PlanConfig", "plan"]
