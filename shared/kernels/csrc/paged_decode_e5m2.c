/* paged_decode.c over a float8 e5m2 KV cache: paged_decode_e5m2 and decode_heads_e5m2 (see kv.h). */
#define KV_KIND 3
#include "paged_decode.c"
