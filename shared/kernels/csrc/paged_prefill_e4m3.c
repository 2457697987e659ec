/* paged_prefill.c over a float8 e4m3 KV cache: paged_prefill_e4m3 and write_kv_e4m3 (see kv.h). */
#define KV_KIND 2
#include "paged_prefill.c"
