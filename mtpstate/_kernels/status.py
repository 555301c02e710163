"""What a kernel reports: its status codes, and where the failing item is in
the step (phase: which input; field: which attribute). The Python side
(``mtpstate.step_errors``) turns them into a :class:`mtpstate.StateError`
that names the request and the field. Also the kinds of int vectors the
kernels read in place."""

# status codes
OK = 0
E_NOT_CANONICAL = 1  # a type the fast path does not take: normalize in Python, retry
E_KEY_TOO_LONG = 2  # the key arena is too small for this call's long ids: grow it in Python, retry
E_STAGE_FULL = 3  # staging buffer too small: grow in Python, retry
E_NOT_STR = 4
E_UNKNOWN = 5
E_DUPLICATE = 6
E_LIVE = 7
E_CAPACITY = 8
E_NCT_RANGE = 9
E_NEW_NCT_RANGE = 10
E_TOO_LONG = 11
E_GROUPS = 12
E_BLOCK_OVERFLOW = 13
E_BLOCK_VALUE = 14
E_TOKEN_VALUE = 15
E_MAX_TOKENS = 16
E_LENGTHS = 17
E_INT_RANGE = 18  # an int outside int64 (or outside what its field allows)
E_ID_TOO_LONG = 19  # a request id longer than max_id_bytes
E_CHANGED = 20  # a dict's item count disagrees with its items (defensive: the GIL is held)
E_COUNT_VALUE = 21  # a scheduled-token count outside [0, 2**31)
E_TOTAL = 22  # total_num_scheduled_tokens differs from the sum of the counts
E_BATCH_SIZE = 23  # more scheduled requests than rows
E_NEW_SLOW = 24  # a new request's attribute of a type not read in place: read the new requests in Python, retry
E_NEW_READ = 25  # reading a new request's attribute raised (the exception is in the holder list)

# phases, reported in the error context: which input the failing item is in
PH_FINISH = 0  # finished_req_ids
PH_NEW = 1  # scheduled_new_reqs
PH_CACHED = 2  # scheduled_cached_reqs
PH_PREEMPT = 3  # preempted_req_ids
PH_RESUMED = 4  # scheduled_cached_reqs.resumed_req_ids
PH_BATCH = 5  # num_scheduled_tokens
PH_SPEC = 6  # scheduled_spec_decode_tokens

# fields, reported in the error context: which attribute of the item
FLD_NONE = 0
FLD_REQ_ID = 1
FLD_PROMPT_LEN = 2
FLD_TOKENS = 3  # prefill_token_ids
FLD_NCT = 4  # num_computed_tokens
FLD_MAX_TOKENS = 5
FLD_BLOCKS = 6  # block_ids / new_block_ids
FLD_COUNT = 7  # the value of a num_scheduled_tokens entry
FLD_DRAFTS = 8  # the value of a scheduled_spec_decode_tokens entry
FLD_TOTAL = 9  # total_num_scheduled_tokens

# kinds of int vectors the kernels read in place (token ids, counts)
V_OBJ = 0  # an exact list or tuple of exact ints: addr is the object
V_ARRAY = 1  # an array.array (or subclass): addr is the object, layout read at kernel time
V_I32 = 2  # raw C-contiguous buffers: addr is the data, length given
V_I64 = 3
V_U32 = 4
V_U64 = 5

INT32_MAX = 2147483647
