"""Named slots of the contexts and argument tuple the kernels share.

One place for every index into the index context (``IX_*``: the hash
table's arrays, the builtin types' addresses), the table context (``TB_*``), the state
array's fields (``F_*``), the scratch rows (``S_*``), the batch arrays
(``B_*``, ``BB_*``, ``BO_*``), a new request's descriptor (``N_*``) and the
step's argument tuple (``A_*``). The Python side (table.py, mirror.py) and the
step kernels read them from here.
"""

from mtpstate._kernels.jit import jit

# per-row int32 fields of the state array, [NUM_FIELDS, max_num_reqs]
F_NCT = 0  # num_computed_tokens
F_NCPT = 1  # num_computed_prefill_tokens
F_PREFILL = 2  # prefill_len
F_PROMPT = 3  # prompt_len
F_MAXSEQ = 4  # max_seq_len
F_NB = 5  # num_blocks of group g at F_NB + g

# table context slots (int64; addresses of the arrays the table owns)
TB_STATE = 0  # addr int32[F_NB + ng, R]
TB_R = 1
TB_NG = 2
TB_BT_ADDR = 3  # addr int64[ng]: address of each group's block table [R, W_g]
TB_BT_W = 4  # addr int64[ng]: W_g
TB_TOK = 5  # addr int32[R, L]
TB_L = 6
# The prediction state is double-buffered ([2, R] each): a step reads buffer
# TB_PREV_CUR and writes the other, which becomes current only if the step
# is accepted, so a rejected step leaves the prediction as it was.
TB_PREV_OBJ = 7  # addr int64[2, R]: id objects of the previous update, by position
TB_PREV_ROW = 8  # addr int32[2, R]: their rows (-1 once freed)
TB_ROW_PREV_POS = 9  # addr int32[2, R]: position of each row (valid where prev_row points back)
TB_PREV_N = 10
TB_SCR = 11  # addr int32[NUM_SCR, R] scratch
TB_STAMP = 12
TB_ERR_POS = 13  # error detail: position of the item in its input
TB_ERR_ARG = 14  # error detail: the offending value, group, ...
TB_ERR_PHASE = 15  # error detail: PH_* (which input)
TB_STG_POS = 16  # addr int64[cap]: flat positions of changed elements (token ids apart: TB_TOK_*)
TB_STG_VAL = 17  # addr int32[cap]: their values
TB_STG_CAP = 18
TB_STG_N = 19
TB_STG_ON = 20
TB_FLAT_BT = 21  # addr int64[ng]: flat offset of each block table
TB_FLAT_TOK = 22  # flat offset of token_ids; -1: not mirrored
TB_ERR_FIELD = 23  # error detail: FLD_* (which attribute)
TB_PREV_CUR = 24  # which prediction buffer is current
TB_PREV_OWNED = 25  # 1: the table holds a reference to each object of the current buffer
TB_STG_DUPS = 26  # 1: this step staged some element twice (a row added and updated by it)
TB_RES = 27  # addr int32[3 * R]: rows of the step: cached then new at [0, 2R), freed at [2R, 3R)
TB_RES_NC = 28  # number of cached rows in the result
TB_RES_NN = 29  # number of new rows (they follow the cached ones)
TB_RES_NF = 30  # number of freed rows (ascending)
# the batch of the step (BatchReqState), computed when TB_DQL > 0
TB_DQL = 31  # decode_query_len (speculative steps + 1); 0: no batch
TB_BATCH = 32  # addr int32[B_ROWS, R]: batch outputs and scratch, by batch position
TB_BATCH_IDX = 33  # addr intp[R]: idx_mapping (batch position -> row)
TB_BATCH_BOOL = 34  # addr bool[BB_ROWS, R]
TB_BATCH_OBJ = 35  # addr int64[BO_ROWS, R]: key objects by dict position, sort keys
TB_B_N = 36  # requests in the batch; -1: no batch this step
TB_B_NUM_TOKENS = 37
TB_B_MAX_QUERY = 38
TB_B_HAS_PREFILL = 39
TB_B_GRAPH_OK = 40  # decode_graph_eligible
TB_B_HAS_DRAFTS = 41  # the step's scheduled_spec_decode_tokens is not empty
TB_B_STAMP = 42  # stamp of the row -> batch position map
TB_B_HOLDER = 43  # id of a 1-item list the kernel puts the batch's req_ids list into
TB_B_NEXT_N = 44  # the batch size found by the resolve pass, for the write pass
# what the device mirror ships (set once by mirror.py)
TB_STG_FIELDS = 45  # bit f: state field f (F_*, num_blocks rows included) is mirrored; others are not staged
TB_FLAT_ENG = 46  # flat offset of the engine's [2, R] lengths (ENG_*), written for added rows only; -1: none
TB_TOK_EXT = 47  # 1: a new request's token ids are staged for an external target (not the flat tensor)
TB_STG_TOK_N = 48  # token elements the step staged (the slot's token area holds the first TB_TOK_CAP)
TB_STG_STRIDE = 49  # row stride of the per-request rows (state, engine lengths) on the device: R rounded up to 4
# new requests read in place (A_NEW_REQS): the attribute names to read and
# the list that holds what was read (see H_*)
TB_NEW_NAMES = 50  # addr int64[H_STRIDE]: array.array (at H_REQ), then the name str of each attribute
TB_NEW_HOLDER = 51  # id of a 1-item list the kernel puts the step's holder list into (table.py empties it)
# new requests' token ids for the device (a token target or the mirrored
# token_ids): staged apart from the other elements, in the open slot's token
# area as far as it holds them, and described as runs for the rest (see
# _kernels/tokens.py). The token area follows the slot's elements in the
# same buffers: positions at TB_STG_POS + 8 * (TB_STG_CAP + STG_META), values
# at TB_STG_VAL + 4 * TB_STG_CAP
TB_TOK_CAP = 52  # token elements a slot's token area holds
TB_TOK_RUNS = 53  # addr int64[max_num_reqs, TR_STRIDE]: the step's token runs, one per new request
# the step's inputs for the forward (prepare_inputs' host arrays), written
# with the batch: into the open slot's pinned buffer when the device mirror
# ships them, else into the table's own
TB_BIN = 54  # addr int32[BI_ROWS, R + 1] (see BI_*)
TB_BONUS = 55  # sampled tokens per request and step besides its drafts (vLLM: num_new_sampled_tokens_per_step)
TB_B_NUM_LOGITS = 56  # the batch's logits: num_reqs * bonus + its drafts
TB_B_NUM_DRAFTS = 57  # the batch's draft tokens
TB_B_LOGITS_FIT = 58  # 1: every request is scheduled at least its drafts + bonus tokens
# the batch's logits expanded (vLLM's expand_idx_mapping): each request's row
# and 0..k-1 over its k = drafts + bonus logits, written with the inputs
TB_BEXP = 59  # addr int64[TB_B_EXP_CAP]: expanded_idx_mapping (the int32 expanded_local_pos follows the BI_* rows)
TB_B_EXP_CAP = 60  # logits the expanded arrays hold; 0: not written
TB_B_EXP_OK = 61  # 1: written (every request's k <= decode_query_len, and they fit)
TB_SIZE = 62
STG_META = 2  # int64 header before an area's positions (the mirror's live-element count)

# one token run: a new request's prefill token ids and where they go
TR_DST = 0  # position of its first token in the token target
TR_KIND = 1  # V_* kind of the source
TR_SRC = 2  # its address (the table's host row, or the request's own, held until apply returns)
TR_N = 3  # tokens
TR_STRIDE = 4

# rows of the engine's lengths region (TB_FLAT_ENG): seeded when a request is
# added, then advanced by the engine's own device code, never by the host
ENG_TOTAL_LEN = 0  # prefill length (prompt + output so far)
ENG_NCT = 1  # num_computed_tokens
ENG_ROWS = 2

# the descriptor of one new request: NEW_STRIDE int64 of the kernel's
# descriptor array, filled from the request's attributes read in place or
# from the flat list of ints table.py builds in the general path (the
# holder list, or table.py, holds every object these addresses point to)
N_KEY = 0  # address of the req_id str
N_PLEN = 1  # prompt_len
N_NCT = 2  # num_computed_tokens
N_MAXT = 3  # max_tokens
N_TOK_KIND = 4  # V_* kind of prefill_token_ids
N_TOK = 5  # its address
N_TOK_N = 6  # its length (raw buffers)
N_BLK = 7  # address of the block_ids tuple (one list per group)
NEW_STRIDE = 8

# a new request read in place: what the kernel read, H_STRIDE slots per
# request of the holder list (None where not read); a slot whose read raised
# holds the exception
H_REQ = 0  # the NewRequestData itself
H_REQ_ID = 1
H_PROMPT = 2  # prompt_token_ids
H_PREFILL = 3  # prefill_token_ids
H_BLOCKS = 4  # block_ids
H_NCT = 5  # num_computed_tokens
H_SP = 6  # sampling_params
H_MAX_TOKENS = 7  # sampling_params.max_tokens
H_STRIDE = 8

# the general step's counters, one int64 record its phases share (step.py,
# add.py, update.py)
SC_STAMP = 0  # this step's stamp (marks in the scratch rows)
SC_NN = 1  # new requests
SC_NFREED = 2  # rows freed (finished, preempted, re-sent ids)
SC_NRES = 3  # resumed ids
SC_NC = 4  # cached requests
SC_HITS = 5  # cached ids found by identity prediction
SC_NMISS = 6  # cached ids that were not
SC_NSTAGE = 7  # elements the step will stage (capacity check)
SC_NTOK = 8  # token elements the step stages (for a token target or the mirrored token_ids)
SC_SIZE = 9

# scratch rows
S_ROWS = 0  # cached position -> row
S_NCT = 1  # cached position -> num_computed_tokens
S_FREE = 2  # stamp: row freed by this step
S_SEEN = 3  # stamp: row updated by this step
S_REDIRECT = 4  # freed row -> row its id is re-added at, -1
S_NEW = 5  # stamp: row assigned to a new request by this step
S_NEWPOS = 6  # row -> index of that new request
S_FREED = 7  # list of freed rows
S_NEWROW = 8  # new request index -> row
S_PRIOR = 9  # new request index -> its live row before the step, -1
S_MISS = 10  # positions of this update that were not identity hits (a list)
S_FLAGS = 11  # cached position -> 1 if its new blocks replace the row (resumed)
S_NB0 = 12  # + g: per-new-request block counts of group g


def num_scratch_rows(ng):
    return S_NB0 + ng


# int32 rows of the batch array, [B_ROWS, max_num_reqs]: outputs (in batch
# order) first, then scratch (in the order of num_scheduled_tokens)
B_NUM_SCHED = 0  # num_scheduled_tokens
B_DRAFTS = 1  # num_draft_tokens
B_PREFILL = 2  # prefill_len
B_NCPT = 3  # num_computed_prefill_tokens
B_MAXSEQ = 4  # max_seq_len
B_POS_ROW = 5  # dict position -> row
B_POS_NUM = 6  # dict position -> scheduled tokens
B_POS_DRAFTS = 7  # dict position -> draft tokens
B_ROW_STAMP = 8  # row -> TB_B_STAMP when the row is in the batch
B_ROW_POS = 9  # row -> dict position (valid where stamped)
B_PERM = 10  # batch position -> dict position
B_ROWS = 11
# bool rows, [BB_ROWS, max_num_reqs]
BB_PREFILLING = 0  # is_prefilling
BB_RUNS_AS_DECODE = 1  # prefill_runs_as_decode
BB_ROWS = 2
# int64 rows, [BO_ROWS, max_num_reqs]
BO_KEYS = 0  # key objects of num_scheduled_tokens, by dict position (the batch's req_ids)
BO_SORT = 1  # sort keys (tokens << 32 | position) of the extend/prefill classes
BO_ROWS = 2

# rows of the step's inputs (TB_BIN), by batch position, each R + 1 long;
# then TB_B_EXP_CAP int32 of expanded_local_pos. cu_num_logits is the last
# row, so that it and expanded_local_pos ship as one contiguous copy
BI_QSL = 0  # query_start_loc: 0, then the running sum of num_scheduled_tokens; num_tokens past num_reqs
BI_SEQ_UB = 1  # seq_lens_cpu_upper_bound: num_computed_tokens + num_scheduled_tokens; 0 past num_reqs
BI_NCT = 2  # num_computed_tokens of the batch's rows
BI_CU_LOGITS = 3  # cu_num_logits: 0, then the running sum of drafts + bonus
BI_ROWS = 4

# The step's inputs, one tuple the Python side builds (table.py) and holds
# for the call: the kernel takes its address, so a launch costs one argument
# whatever the step carries. None = absent.
A_FIN = 0  # finished_req_ids: list/tuple of ids
A_PRE = 1  # preempted_req_ids
A_NEW = 2  # flat list of new-request descriptors (N_*), built in Python (the general path)
A_CID = 3  # scheduled_cached_reqs.req_ids
A_CNCT_KIND = 4  # num_computed_tokens as an int vector: V_* kind (int)
A_CNCT = 5  # its address (int)
A_CNCT_N = 6  # its length, for raw buffers (int)
A_CBLK = 7  # new_block_ids
A_CRES = 8  # resumed_req_ids
A_NST = 9  # num_scheduled_tokens: an exact dict (batch only)
A_SPEC = 10  # scheduled_spec_decode_tokens: an exact dict, or None
A_TOTAL = 11  # total_num_scheduled_tokens: an int, or None (not checked)
A_NEW_REQS = 12  # scheduled_new_reqs as an exact list/tuple the kernel reads in place (A_NEW is then None)
A_SIZE = 13


@jit(signature="int64(int64[::1], int64, int64, int64, int64, int64)")
def _err(tb, code, pos, arg, phase, field):
    """Leave an error's detail in the table context (which input, which
    item, which field, the offending value) and return its status."""
    tb[TB_ERR_POS] = pos
    tb[TB_ERR_ARG] = arg
    tb[TB_ERR_PHASE] = phase
    tb[TB_ERR_FIELD] = field
    return code


# ----------------------------------------------------------------------------
# the index context (mtpstate.index.RequestIndex): int64 array, one named slot each

IX_SLOTS = 0  # addr int64[table_size]: (hash tag << 32 | row) per slot, -1 empty
IX_MASK = 1  # table_size - 1
IX_ROW_HASH = 2  # addr uint64[capacity]
IX_KEYS = 3  # addr uint64[capacity * KEY_WORDS]: per row [length, UTF-8 bytes zero padded] (see _key_matches_row)
IX_KW = 4  # KEY_WORDS
IX_KEY_LEN = 5  # addr int32[capacity]: key length, -1 = free row
IX_CAP = 6
IX_NUM_LIVE = 7
IX_FREE_HINT = 8  # every row below it is live
IX_SEED = 9
IX_HMASK = 10  # hash bits kept (tests force collisions with a small mask)
IX_ALLOW_BYTES = 11  # set by the generic path for ids without a UTF-8 form
IX_ERR_POS = 12
IX_ERR_ARG = 13
IX_ERR_PHASE = 14
# Addresses of the builtin types and singletons. They change from process to
# process (ASLR), so they are read at run time, never frozen into the cached
# machine code as constants.
IX_T_LIST = 15
IX_T_TUPLE = 16
IX_T_STR = 17
IX_T_BYTES = 18
IX_T_INT = 19
IX_NONE = 20
IX_TRUE = 21
IX_FALSE = 22
IX_ASCII_OFF = 23  # data offset of compact ASCII str objects, 0 = read them through the C API
IX_MAX_KEY = 24  # max_id_bytes: longer ids are refused (new) or cannot be live (lookups)
IX_ARRAY_OK = 25  # 1: array.array's object layout was verified at import (ob_item, ob_descr)
IX_T_DICT = 26
IX_DICT_OK = 27  # 1: dict entries are read in place (layout verified at import), 0: PyDict_Next
# the arena of long keys (longer than INLINE_BYTES): uint64 words, bump
# allocated; a row's words stay until the Python side compacts the arena
IX_ARENA = 28  # addr uint64[IX_ARENA_CAP]
IX_ARENA_CAP = 29
IX_ARENA_TOP = 30  # words allocated so far
IX_ARENA_LIVE = 31  # words of live keys
IX_SIZE = 32
