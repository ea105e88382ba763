"""carpool's digital twin: cost profiles measured on real hardware, and a simulator over them.

A cost profile says what a forward pass costs on one machine, per model the serve config
serves: for encoders a pass-cost model in padded tokens, for generators the cost of a prefill
step by prompt tokens and of a decode step by batch size and context, plus KV bytes per token.
``python -m carpool_twin profile`` measures one (``carpool_twin.measure``); the file format,
its fits and its provenance rules live in ``carpool_twin.profile``. Measuring imports
no Ray, Serve, FastAPI or pydantic: a profile is measured on a bare GPU machine with torch.

``carpool_twin.sim`` (with ``replicas``, ``topology`` and ``traffic``) simulates a serve config
on a profile with carpool's own policy code (pydantic configs, no Ray); ``carpool_twin.plan``
and ``python -m carpool_twin.planner`` plan replicas and knobs with it; ``carpool_twin.project``
projects a traffic mix onto N GPUs. ``python -m carpool_twin.prefix`` (``prefix_engine``,
``prefix_policies``, ``prefix_sim``) simulates placement across replicas that cache prompt
prefixes, with carpool's own router, and checks it against the Mooncake replay's runs.
"""

from carpool_twin.profile import (
    SCHEMA_VERSION,
    ProfileError,
    fit_line,
    fit_terms,
    load_profile,
    predict_ms,
    save_profile,
    validate_profile,
)

__all__ = [
    "SCHEMA_VERSION",
    "ProfileError",
    "fit_line",
    "fit_terms",
    "load_profile",
    "predict_ms",
    "save_profile",
    "validate_profile",
]
