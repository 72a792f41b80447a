"""The control protocol between the router and P / MD: routes, messages, the error type.

Foundation layer (imports nothing from router/ or sglang_glue/): the router's clients
(router/backends/clients.py), the servers (sglang_glue/md/main_drc.py's MdControlApi,
sglang_glue/p/prefill_control.py), the test fakes and the benchmarks all build and parse the
control calls with these types, so the contract lives here once (docs/architecture.md,
"The control protocol").
"""

from sglang_pdd.protocol.errors import ControlError, bad_request
from sglang_pdd.protocol.kv_size import KvSize
from sglang_pdd.protocol.messages import (HANDOFF_LOGPROB_FIELDS, MAX_MD_TP, MAX_TOKEN_ID, PARAM_PREFIX, READY_STATES,
                                          RESUME_KEY, DestinationReply, DropReply, HandoffRequest, InfoReply, KeptReply,
                                          HealthReply, KvSendersReply, KvSendersRequest, LegParams, Message, ReadyReply,
                                          ReadyRequest, RegisterReply, RegisterRequest, ReleaseReply, ReleaseRequest,
                                          WanDestinationRequest, check_md_tp, is_int, resume_marker,
                                          without_pdd_params)
from sglang_pdd.protocol.routes import (HEALTH, MAX_ROOM_ID, MD_HANDOFF, MD_KV_SENDERS, MD_READY, MD_REGISTER,
                                        MD_RELEASE, MD_ROUTES, P_DESTINATION, P_DROP, P_INFO, P_KEPT, P_ROUTES, STATS, Route,
                                        RouteTable, is_p_path, parse_room_id, ready_target, release_target)
