"""rolloutd-client: the trainer side of rolloutd.

    from rolloutd_client import Client
    c = Client("http://127.0.0.1:30000")
    outs = c.generate([[151644, 872, 198]], n=8, max_new_tokens=512, temperature=1.0)
    c.push_weights(model.state_dict(), version="18")            # shared memory, BF16
    w = rolloutd_client.tis.tis_weights(lp_train, outs[0].output_logprobs, cap=2.0)

    fleet = rolloutd_client.Fleet([url0, url1, url2])             # many daemons as one
    fleet.generate(prompts, n=8, max_new_tokens=512)                # least-loaded routing
    fleet.push_weights(model.state_dict(), version="19")           # all commit "19", or none

Modules: client (Client, GenerateResult, PushResult, RolloutdError), fleet (Fleet, FleetError),
fleet_push (the all-or-none fleet push: FleetPushResult, FleetPushError), shm (the shm transport),
tensors (accepted state-dict values), fp8 (client-side blockwise E4M3 quantization), tis (TIS / MIS
rollout correction), safetensors (a minimal reader), dtypes (bfloat16 / e4m3 codecs).
"""
from . import fp8, safetensors, tis
from .client import Client, GenerateResult, PushResult, RolloutdError
from .fleet import Fleet, FleetError
from .fleet_push import FleetPushError, FleetPushResult

__version__ = "0.1.0"
__all__ = ["Client", "Fleet", "FleetError", "FleetPushError", "FleetPushResult", "GenerateResult", "PushResult",
           "RolloutdError", "fp8", "safetensors", "tis"]
