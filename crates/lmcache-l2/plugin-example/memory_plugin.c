/*
 * An example lmcache-rs native L2 plugin: an in-memory object store behind the C ABI of
 * include/lmcache_rs_l2_plugin.h. Operations are queued and run on the plugin's own worker
 * thread; each completion is queued and signalled on an eventfd, as the ABI asks.
 *
 * Build: gcc -shared -fPIC -O2 -pthread -I ../include -o libmemory_plugin.so memory_plugin.c
 *
 * Config (the adapter's "config" object, as JSON text):
 *   "capacity_bytes": N     refuse puts beyond N stored bytes (-ENOSPC); 0 = unbounded
 *   "corrupt": true         flip one byte of every object it returns (a lying plugin: the
 *                           blob checks must turn that into a miss)
 *   "refuse": true          refuse every submission (-EBUSY)
 *   "stall_ms": N           wait N ms before running each op (a slow backend)
 * The tests also build it with -DEXAMPLE_ABI_VERSION=N to check the version handshake.
 */
#include "lmcache_rs_l2_plugin.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#ifndef EXAMPLE_ABI_VERSION
#define EXAMPLE_ABI_VERSION LMRS_L2_PLUGIN_ABI_VERSION
#endif

#define BUCKETS 4096

typedef struct entry {
    char *key;
    size_t key_len;
    uint8_t *data;
    size_t len;
    struct entry *next;
} entry;

enum { OP_PUT, OP_GET, OP_EXISTS, OP_DELETE };

typedef struct op {
    int kind;
    uint64_t id;
    size_t n;
    const lmrs_l2_key *keys;
    const lmrs_l2_value *values;
    const lmrs_l2_buffer *buffers;
    int64_t *results;
    struct op *next;
} op;

typedef struct plugin {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    op *head, *tail;
    lmrs_l2_completion *done;
    size_t ndone, capdone;
    entry *buckets[BUCKETS];
    size_t used, capacity;
    int corrupt, refuse, stop;
    long stall_ms;
    int efd;
    pthread_t worker;
} plugin;

static uint64_t hash(const char *k, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)k[i]) * 1099511628211ull;
    return h;
}

static entry **find(plugin *p, const lmrs_l2_key *k) {
    entry **e = &p->buckets[hash(k->ptr, k->len) % BUCKETS];
    while (*e && !((*e)->key_len == k->len && memcmp((*e)->key, k->ptr, k->len) == 0)) e = &(*e)->next;
    return e;
}

static void run(plugin *p, op *o) {
    for (size_t i = 0; i < o->n; i++) {
        entry **e = find(p, &o->keys[i]);
        switch (o->kind) {
        case OP_PUT: {
            if (*e) { o->results[i] = 1; break; }
            const lmrs_l2_value *v = &o->values[i];
            size_t len = v->head_len + v->body_len;
            if (p->capacity && p->used + len > p->capacity) { o->results[i] = -ENOSPC; break; }
            entry *n = calloc(1, sizeof *n);
            uint8_t *data = malloc(len ? len : 1);
            char *key = malloc(o->keys[i].len ? o->keys[i].len : 1);
            if (!n || !data || !key) { free(n); free(data); free(key); o->results[i] = -ENOMEM; break; }
            memcpy(key, o->keys[i].ptr, o->keys[i].len);
            if (v->head_len) memcpy(data, v->head, v->head_len);
            if (v->body_len) memcpy(data + v->head_len, v->body, v->body_len);
            n->key = key; n->key_len = o->keys[i].len; n->data = data; n->len = len;
            *e = n;
            p->used += len;
            o->results[i] = 0;
            break;
        }
        case OP_GET: {
            if (!*e) { o->results[i] = LMRS_L2_ABSENT; break; }
            const lmrs_l2_buffer *b = &o->buffers[i];
            if ((*e)->len != b->len) { o->results[i] = -EMSGSIZE; break; }
            if (b->len) memcpy(b->ptr, (*e)->data, b->len);
            if (p->corrupt && b->len) b->ptr[b->len / 2] ^= 0x5a;
            o->results[i] = (int64_t)b->len;
            break;
        }
        case OP_EXISTS:
            o->results[i] = *e ? (int64_t)(*e)->len : LMRS_L2_ABSENT;
            break;
        case OP_DELETE:
            if (!*e) { o->results[i] = 0; break; }
            {
                entry *gone = *e;
                *e = gone->next;
                p->used -= gone->len;
                free(gone->key); free(gone->data); free(gone);
            }
            o->results[i] = 1;
            break;
        }
    }
}

static void *work(void *arg) {
    plugin *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->head && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
        op *o = p->head;
        if (!o) { pthread_mutex_unlock(&p->mu); return NULL; }
        p->head = o->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->mu);

        if (p->stall_ms > 0) {
            struct timespec t = {p->stall_ms / 1000, (p->stall_ms % 1000) * 1000000L};
            nanosleep(&t, NULL);
        }
        run(p, o); /* only this thread touches the table */

        pthread_mutex_lock(&p->mu);
        if (p->ndone == p->capdone) {
            size_t cap = p->capdone ? p->capdone * 2 : 64;
            lmrs_l2_completion *d = realloc(p->done, cap * sizeof *d);
            if (d) { p->done = d; p->capdone = cap; }
        }
        if (p->ndone < p->capdone) {
            p->done[p->ndone].op_id = o->id;
            p->done[p->ndone].status = 0;
            p->done[p->ndone].reserved = 0;
            p->ndone++;
        }
        pthread_mutex_unlock(&p->mu);
        free(o);
        uint64_t one = 1;
        ssize_t w = write(p->efd, &one, sizeof one);
        (void)w;
    }
}

static int has_true(const char *json, const char *name) {
    const char *at = strstr(json, name);
    if (!at) return 0;
    at = strchr(at + strlen(name), ':');
    if (!at) return 0;
    while (*++at == ' ') {}
    return strncmp(at, "true", 4) == 0;
}

static void *create(const char *config, char *error, size_t error_len) {
    plugin *p = calloc(1, sizeof *p);
    if (!p) { snprintf(error, error_len, "out of memory"); return NULL; }
    const char *cap = strstr(config, "\"capacity_bytes\"");
    if (cap && (cap = strchr(cap, ':'))) p->capacity = strtoull(cap + 1, NULL, 10);
    if (strstr(config, "\"bad\"")) { snprintf(error, error_len, "bad: not a setting of this plugin"); free(p); return NULL; }
    const char *stall = strstr(config, "\"stall_ms\"");
    if (stall && (stall = strchr(stall, ':'))) p->stall_ms = strtol(stall + 1, NULL, 10);
    p->corrupt = has_true(config, "\"corrupt\"");
    p->refuse = has_true(config, "\"refuse\"");
    p->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (p->efd < 0) { snprintf(error, error_len, "eventfd: %s", strerror(errno)); free(p); return NULL; }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (pthread_create(&p->worker, NULL, work, p) != 0) {
        snprintf(error, error_len, "cannot start its worker");
        close(p->efd); free(p); return NULL;
    }
    return p;
}

static void destroy(void *self) {
    plugin *p = self;
    pthread_mutex_lock(&p->mu);
    p->stop = 1; /* the worker finishes what is queued, then exits */
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->worker, NULL);
    for (size_t b = 0; b < BUCKETS; b++) {
        for (entry *e = p->buckets[b]; e;) { entry *n = e->next; free(e->key); free(e->data); free(e); e = n; }
    }
    free(p->done);
    close(p->efd);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

static int event_fd(void *self) { return ((plugin *)self)->efd; }

static int submit(plugin *p, int kind, uint64_t id, size_t n, const lmrs_l2_key *keys,
                  const lmrs_l2_value *values, const lmrs_l2_buffer *buffers, int64_t *results) {
    if (p->refuse) return -EBUSY;
    op *o = calloc(1, sizeof *o);
    if (!o) return -ENOMEM;
    o->kind = kind; o->id = id; o->n = n; o->keys = keys; o->values = values;
    o->buffers = buffers; o->results = results;
    pthread_mutex_lock(&p->mu);
    if (p->tail) p->tail->next = o; else p->head = o;
    p->tail = o;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

static int submit_put(void *s, uint64_t id, size_t n, const lmrs_l2_key *k, const lmrs_l2_value *v, int64_t *r) {
    return submit(s, OP_PUT, id, n, k, v, NULL, r);
}
static int submit_get(void *s, uint64_t id, size_t n, const lmrs_l2_key *k, const lmrs_l2_buffer *b, int64_t *r) {
    return submit(s, OP_GET, id, n, k, NULL, b, r);
}
static int submit_exists(void *s, uint64_t id, size_t n, const lmrs_l2_key *k, int64_t *r) {
    return submit(s, OP_EXISTS, id, n, k, NULL, NULL, r);
}
static int submit_delete(void *s, uint64_t id, size_t n, const lmrs_l2_key *k, int64_t *r) {
    return submit(s, OP_DELETE, id, n, k, NULL, NULL, r);
}

static size_t drain_completions(void *self, lmrs_l2_completion *out, size_t cap) {
    plugin *p = self;
    pthread_mutex_lock(&p->mu);
    size_t n = p->ndone < cap ? p->ndone : cap;
    memcpy(out, p->done, n * sizeof *out);
    memmove(p->done, p->done + n, (p->ndone - n) * sizeof *out);
    p->ndone -= n;
    pthread_mutex_unlock(&p->mu);
    return n;
}

static const lmrs_l2_plugin_api API = {
    .abi_version = EXAMPLE_ABI_VERSION,
    .api_size = sizeof(lmrs_l2_plugin_api),
    .name = "example-memory",
    .create = create,
    .destroy = destroy,
    .event_fd = event_fd,
    .submit_put = submit_put,
    .submit_get = submit_get,
    .submit_exists = submit_exists,
    .submit_delete = submit_delete,
    .drain_completions = drain_completions,
};

const lmrs_l2_plugin_api *lmcache_rs_l2_plugin_v1(void) { return &API; }
