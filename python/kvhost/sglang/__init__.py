"""SGLang's KV connector classes backed by ``kvhost serve`` (see
:mod:`kvhost.sglang.conn`), and the launcher ``python -m
kvhost.sglang.launch`` that makes SGLang's ``--disaggregation-transfer-backend
kvhost`` choose them (:mod:`kvhost.sglang.launch`)."""

from kvhost.sglang.conn import (  # noqa: F401
    HAVE_SGLANG,
    DisaggregationMode,
    KVArgs,
    KVBootstrapServer,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
    KVTransferMetric,
    PrefillServerInfo,
    StateType,
    regions_for_pointers,
    state_components,
)

# The names SGLang's other backends use (NixlKVManager, ...), for readers
# who look for them.
KVHostKVManager = KVManager
KVHostKVSender = KVSender
KVHostKVReceiver = KVReceiver
KVHostKVBootstrapServer = KVBootstrapServer
