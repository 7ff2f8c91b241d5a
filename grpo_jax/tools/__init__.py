"""Tools a policy can call between turns (issue 44): `sandbox.run_python`, model-written Python
in a fresh, limited interpreter."""

from grpo_jax.tools.sandbox import SandboxLimits, ToolResult, run_python

__all__ = ["SandboxLimits", "ToolResult", "run_python"]
