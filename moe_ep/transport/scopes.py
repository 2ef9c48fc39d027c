"""The scopes the transport's exchanges are issued under."""

# Every exchange is issued under one of these scopes, which reach the compiled
# HLO's op_name metadata: tests and profiles tell the four passes apart by them.
NAMED_SCOPES = {
    "dispatch": "moe_dispatch_fwd",
    "combine": "moe_combine_fwd",
    "dispatch_bwd": "moe_dispatch_bwd",
    "combine_bwd": "moe_combine_bwd",
}
