/*
 * lmcache-rs native L2 plugin ABI, version 1.
 *
 * A plugin is a shared library that stores opaque byte objects under string keys, the way
 * LMCache's native connectors (fs_native, resp, mooncake, ...) do: batched operations are
 * submitted, run on the plugin's own threads, and their completions are signalled through
 * one eventfd. lmcache-rs loads it with
 *
 *     --l2-adapter '{"type": "native_plugin", "path": "/path/libfoo.so", "config": {...}}'
 *
 * and calls it only through the table that lmcache_rs_l2_plugin_v1() returns.
 *
 * Handshake. The table starts with abi_version and api_size; lmcache-rs refuses, naming the
 * plugin and both versions, a table whose abi_version is not LMRS_L2_PLUGIN_ABI_VERSION or
 * whose api_size is smaller than the table it knows.
 *
 * Keys are LMCache's native wire keys ("<model>@<kv_rank 8 hex>@<group hex>@<hash hex>[@<salt>]"),
 * passed as pointer and length (not NUL-terminated). Values are stored as given; lmcache-rs
 * wraps each in a self-checking blob (magic, the full key, lengths, xxh3 checksums), so a
 * plugin that loses, truncates, mixes up or corrupts objects causes misses, never wrong KV.
 *
 * Submission. Each submit_* call takes a caller-chosen op_id, n keys and arrays of n entries,
 * and returns 0 if the operation was accepted (exactly one completion will follow) or a
 * negative errno if it was not (no completion follows). Every array passed to a submit_* call
 * stays valid and untouched by lmcache-rs until that op's completion has been drained; the
 * plugin must not touch them after pushing the completion. Buffers are written only within
 * their len.
 *
 * Completion. When an op is done the plugin fills results[0..n), queues
 * {op_id, status} (status 0, or a negative errno when the whole batch failed), and adds 1 to
 * the eventfd returned by event_fd(). drain_completions() moves up to cap queued completions
 * into out and returns how many; it never blocks. Calls may come from any thread, concurrently.
 *
 * Per-key results:
 *   put     0 written, 1 already present, < 0 a negative errno
 *   get     the object's length in bytes (written into the buffer, which is exactly as long as
 *           the object was when exists reported it), LMRS_L2_ABSENT when absent,
 *           -EMSGSIZE when the object does not fit the buffer, < 0 another errno
 *   exists  the object's length in bytes, or LMRS_L2_ABSENT
 *   delete  1 deleted, 0 absent, < 0 a negative errno
 *
 * destroy() is called once, last: it waits for or abandons what is in flight, and after it
 * returns the plugin never touches any array it was given.
 */
#ifndef LMCACHE_RS_L2_PLUGIN_H
#define LMCACHE_RS_L2_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LMRS_L2_PLUGIN_ABI_VERSION 1u
#define LMRS_L2_ABSENT (-2) /* -ENOENT */

typedef struct lmrs_l2_key {
    const char *ptr;
    size_t len;
} lmrs_l2_key;

/* A value in two parts (lmcache-rs's blob header, then its payload), stored as one object:
 * head followed by body. */
typedef struct lmrs_l2_value {
    const uint8_t *head;
    size_t head_len;
    const uint8_t *body;
    size_t body_len;
} lmrs_l2_value;

typedef struct lmrs_l2_buffer {
    uint8_t *ptr;
    size_t len;
} lmrs_l2_buffer;

typedef struct lmrs_l2_completion {
    uint64_t op_id;
    int32_t status;
    int32_t reserved;
} lmrs_l2_completion;

typedef struct lmrs_l2_plugin_api {
    uint32_t abi_version; /* LMRS_L2_PLUGIN_ABI_VERSION */
    uint32_t api_size;    /* sizeof(lmrs_l2_plugin_api) */
    const char *name;     /* the plugin's name, for logs and errors */
    /* A new instance from the adapter's "config" object as JSON text; NULL on failure, with a
     * NUL-terminated reason written into error (at most error_len bytes). */
    void *(*create)(const char *config_json, char *error, size_t error_len);
    void (*destroy)(void *plugin);
    int (*event_fd)(void *plugin);
    int (*submit_put)(void *plugin, uint64_t op_id, size_t n, const lmrs_l2_key *keys,
                      const lmrs_l2_value *values, int64_t *results);
    int (*submit_get)(void *plugin, uint64_t op_id, size_t n, const lmrs_l2_key *keys,
                      const lmrs_l2_buffer *buffers, int64_t *results);
    int (*submit_exists)(void *plugin, uint64_t op_id, size_t n, const lmrs_l2_key *keys,
                         int64_t *results);
    int (*submit_delete)(void *plugin, uint64_t op_id, size_t n, const lmrs_l2_key *keys,
                         int64_t *results);
    size_t (*drain_completions)(void *plugin, lmrs_l2_completion *out, size_t cap);
} lmrs_l2_plugin_api;

/* The one symbol a plugin exports. */
const lmrs_l2_plugin_api *lmcache_rs_l2_plugin_v1(void);

#ifdef __cplusplus
}
#endif

#endif /* LMCACHE_RS_L2_PLUGIN_H */
