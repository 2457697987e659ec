/* paged_prefill.c over a float8 e5m2 KV cache: paged_prefill_e5m2 and write_kv_e5m2 (see kv.h). */
#define KV_KIND 3
#include "paged_prefill.c"
