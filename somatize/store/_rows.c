/* Keyed BLAKE3 of many rows of one length at once: what somatize/store/_rows.py
 * compiles and loads (ctypes) to name a batch's items in one call.
 *
 *     somatize_rows(data, n, rb, key, out);  // out[16 i ..]: BLAKE3-keyed(key, row i)[:16]
 *     somatize_gather(dst, src, src_rows, rows, n, rb);  // dst row i = src row rows[i]
 *
 *     somatize_serve(data, n, rb, key, keys, table, mask, arena, arena_rows, dst, orb);
 *         // keys as somatize_rows gives them, and each key's row of the served table's
 *         // arena copied into dst row i; returns how many were found (n: dst is whole)
 *
 * Work of 512 KB or more is shared with one helper thread, started once and woken through
 * a futex (pieces taken in turn, what it has not taken when the caller is done taken
 * back): the head does not run while a cached forward answers, so a second core may be
 * free then. Only while the load average leaves a CPU free (on a loaded machine the helper
 * costs more than it does); somatize_set_threads(1) keeps one always. On the 2-core VM
 * this was measured on, a thread started per call cost 77-150 us (a cached epoch of 786 KB
 * batches was 1.83x its head with it, 1.33x without); waking the kept one costs 20-30 us,
 * and serves a batch of 256 rows of 3 KB in 79 us against 121 alone (n=256 in a fit: 309
 * against 473).
 * Written from the BLAKE3 specification (chunks of 1024 bytes, blocks of 64, 7 rounds,
 * a left subtree of the largest power of two of chunks below the whole). Every row of a
 * batch has the same length, so LANES rows go through the same steps side by side, one row
 * per vector lane: the SIMD width the one-call BLAKE3 of the whole batch has (16 lanes
 * with AVX-512, 8 with AVX2, 4 otherwise: a wider vector than the registers hold spills
 * the state, 1.5x slower on AVX2), where one call per row fills 3 lanes (a row of 3 KB).
 * _rows.py checks what it computes against the blake3 package before using it.
 * Little-endian hosts (the check says).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef LANES /* -DLANES=n to try another width */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__) || defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#endif
typedef uint32_t v32 __attribute__((vector_size(4 * LANES)));

static const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                               0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};
enum { CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8, KEYED = 16 };

static inline v32 rotr(v32 x, int n) { return (x >> n) | (x << (32 - n)); }

#define G(a, b, c, d, x, y)                      \
    do {                                         \
        s[a] += s[b] + (x); s[d] = rotr(s[d] ^ s[a], 16); \
        s[c] += s[d]; s[b] = rotr(s[b] ^ s[c], 12);       \
        s[a] += s[b] + (y); s[d] = rotr(s[d] ^ s[a], 8);  \
        s[c] += s[d]; s[b] = rotr(s[b] ^ s[c], 7);        \
    } while (0)

/* the message words each round reads (the permutation applied r times) */
static const uint8_t SCHED[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13}};

/* cv <- compress(cv, m, counter, len, flags), the first 8 words of its output */
static inline __attribute__((always_inline)) void compress(v32 cv[8], const v32 m[16], v32 lo,
                                                           v32 hi, uint32_t len, uint32_t flags) {
    v32 s[16];
    for (int i = 0; i < 8; i++) s[i] = cv[i];
    for (int i = 0; i < 4; i++) s[8 + i] = (v32){} + IV[i];
    s[12] = lo; s[13] = hi; s[14] = (v32){} + len; s[15] = (v32){} + flags;
#pragma GCC unroll 7
    for (int r = 0; r < 7; r++) {
        const uint8_t *z = SCHED[r];
        G(0, 4, 8, 12, m[z[0]], m[z[1]]); G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        G(2, 6, 10, 14, m[z[4]], m[z[5]]); G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        G(0, 5, 10, 15, m[z[8]], m[z[9]]); G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        G(2, 7, 8, 13, m[z[12]], m[z[13]]); G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++) cv[i] = s[i] ^ s[i + 8];
}

/* the words of a block of each lane's row (bytes past the block's len are zero) */
static inline void load(v32 m[16], const uint8_t *const rows[LANES], size_t at, size_t len) {
#ifdef __AVX512F__
    if (len == 64 && LANES == 16) {
        /* 16 rows' blocks loaded, then transposed (16 x 16 words) by unpacks and shuffles */
        __m512i r[16], t[16], u[16];
        for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_si512((const void *)(rows[l] + at));
        for (int k = 0; k < 8; k++) {
            t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
        }
        for (int k = 0; k < 4; k++) {
            u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
            u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
            u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
            u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
        }
        /* u[4k + j], 128-bit lane L: word 4L + j of rows 4k .. 4k + 3 */
        for (int j = 0; j < 4; j++) {
            __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
            __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
            __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
            __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
            __m512i w0 = _mm512_shuffle_i32x4(v0, v2, 0x88), w1 = _mm512_shuffle_i32x4(v0, v2, 0xDD);
            __m512i w2 = _mm512_shuffle_i32x4(v1, v3, 0x88), w3 = _mm512_shuffle_i32x4(v1, v3, 0xDD);
            memcpy(&m[j], &w0, 64);
            memcpy(&m[4 + j], &w1, 64);
            memcpy(&m[8 + j], &w2, 64);
            memcpy(&m[12 + j], &w3, 64);
        }
        return;
    }
#endif
#if defined(__AVX2__)
    if (len == 64 && LANES == 8) {
        /* 8 rows' blocks, each as two halves of 8 words, transposed 8 x 8 twice */
        for (int h = 0; h < 2; h++) {
            __m256i r[8], t[8], u[8];
            for (int l = 0; l < 8; l++)
                r[l] = _mm256_loadu_si256((const __m256i *)(rows[l] + at + 32 * h));
            for (int k = 0; k < 4; k++) {
                t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
                t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
            }
            for (int k = 0; k < 2; k++) {
                u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
                u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
                u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
                u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
            }
            /* u[j] (rows 0-3), u[4 + j] (rows 4-7), 128-bit half L: word 4L + j */
            for (int j = 0; j < 4; j++) {
                __m256i lo = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
                __m256i hi = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
                memcpy(&m[8 * h + j], &lo, 32);
                memcpy(&m[8 * h + 4 + j], &hi, 32);
            }
        }
        return;
    }
#endif
    uint32_t w[LANES][16];
    for (int l = 0; l < LANES; l++) {
        if (len == 64) memcpy(w[l], rows[l] + at, 64);
        else { memset(w[l], 0, 64); memcpy(w[l], rows[l] + at, len); }
    }
    for (int i = 0; i < 16; i++)
        for (int l = 0; l < LANES; l++) m[i][l] = w[l][i]; /* little-endian hosts only */
}

static void parent(v32 out[8], const v32 l[8], const v32 r[8], const v32 key[8],
                   uint32_t flags) {
    v32 m[16];
    for (int i = 0; i < 8; i++) { m[i] = l[i]; m[8 + i] = r[i]; }
    for (int i = 0; i < 8; i++) out[i] = key[i];
    compress(out, m, (v32){}, (v32){}, 64, flags | PARENT);
}

/* the CV of chunks [first, first + n) of every lane's row; root: the whole row's output */
static void subtree(v32 out[8], const uint8_t *const rows[LANES], size_t rb, uint64_t first,
                    uint64_t n, const v32 key[8], int root) {
    if (n == 1) {
        size_t at = (size_t)first * 1024, end = at + 1024 < rb ? at + 1024 : rb;
        size_t blocks = end > at ? (end - at + 63) / 64 : 1;
        v32 m[16], lo = (v32){} + (uint32_t)first, hi = (v32){} + (uint32_t)(first >> 32);
        for (int i = 0; i < 8; i++) out[i] = key[i];
        for (size_t b = 0; b < blocks; b++) {
            size_t off = at + b * 64, len = end - off < 64 ? end - off : 64;
            if (end <= off) len = 0;
            uint32_t f = KEYED | (b == 0 ? CHUNK_START : 0);
            if (b + 1 == blocks) f |= CHUNK_END | (root ? ROOT : 0);
            load(m, rows, off, len);
            compress(out, m, lo, hi, (uint32_t)len, f);
        }
        return;
    }
    uint64_t left = 1;
    while (left * 2 < n) left *= 2; /* the largest power of two below n */
    v32 l[8], r[8];
    subtree(l, rows, rb, first, left, key, 0);
    subtree(r, rows, rb, first + left, n - left, key, 0);
    parent(out, l, r, key, KEYED | (root ? ROOT : 0));
}

/* Work shared with one helper thread, started once and kept (woken through a futex; a
 * thread started per call costs more than it saves below 4 MB): both take pieces of it in
 * turn until none is left, so a helper that gets no CPU soon (a loaded machine) takes none
 * and costs only the wake-up; work it has not taken when the caller is done is taken back.
 * The caller returns once every piece is done. Linux only (elsewhere: the caller alone). */
typedef void (*part_fn)(const void *args, uint64_t from, uint64_t to);
struct pool {
    _Atomic uint64_t next, done, helped;
    _Atomic int refs;
    part_fn fn;
    const void *args;
    uint64_t n, piece;
};
#define HELP_FROM (1u << 19) /* bytes of work from which the helper is asked, by default */
static uint64_t helped_bytes = HELP_FROM;
static int threads = 2; /* at most: 1 where the machine has one CPU, or when set */
static int alone; /* calls left to make alone: the helper got no CPU in time lately */
static long cpus = 1, calls;
static int idle; /* whether the load average leaves a CPU free (read every 64 calls) */

/* 1: the calling thread alone; 2: the helper while a CPU is free; 3: the helper always;
 * from: the bytes of work from which the helper is asked (0: HELP_FROM) */
void somatize_set_threads(int n, uint64_t from) {
    cpus = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n == 3 ? 3 : n > 1 && cpus > 1 ? 2 : 1;
    helped_bytes = from ? from : HELP_FROM;
}

static int a_cpu_free(void) {
    if (threads == 3) return 1;
    if (calls++ % 64 == 0) {
        double load;
        idle = getloadavg(&load, 1) == 1 && load < (double)cpus - 0.5;
    }
    return idle;
}

static void work(struct pool *p, int helper) {
    for (;;) {
        uint64_t from = atomic_fetch_add(&p->next, 1) * p->piece;
        if (from >= p->n) return;
        p->fn(p->args, from, from + p->piece < p->n ? from + p->piece : p->n);
        if (helper) atomic_fetch_add(&p->helped, 1);
        atomic_fetch_add(&p->done, 1);
    }
}

static void release(struct pool *p) {
    if (atomic_fetch_sub(&p->refs, 1) == 1) free(p);
}

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
static _Atomic(struct pool *) posted; /* the work offered to the helper, until it takes it */
static _Atomic uint32_t bell;         /* rung (incremented, then woken) when work is posted */
static int helper_up;                 /* 1: running; -1: it could not be started */

static void futex(_Atomic uint32_t *at, int op, uint32_t v) {
    syscall(SYS_futex, (uint32_t *)at, op, v, NULL, NULL, 0);
}

static void *helper(void *unused) {
    (void)unused;
    for (;;) {
        uint32_t rung = atomic_load(&bell);
        struct pool *p = atomic_exchange(&posted, NULL);
        if (p) {
            work(p, 1);
            release(p);
            continue;
        }
        futex(&bell, FUTEX_WAIT_PRIVATE, rung); /* until the bell moves past rung */
    }
    return NULL;
}

static void forked(void) { helper_up = 0, atomic_store(&posted, NULL); } /* not in a child */

static int start_helper(void) {
    if (helper_up == 0) {
        pthread_t t;
        pthread_attr_t attr;
        int ok = pthread_attr_init(&attr) == 0 &&
                 pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) == 0 &&
                 pthread_create(&t, &attr, helper, NULL) == 0;
        pthread_attr_destroy(&attr);
        helper_up = ok ? 1 : -1;
        if (ok) pthread_atfork(NULL, NULL, forked);
    }
    return helper_up == 1;
}

static int offer(struct pool *p) { /* 0: another thread's work is posted (run alone) */
    struct pool *none = NULL;
    if (!atomic_compare_exchange_strong(&posted, &none, p)) return 0;
    atomic_fetch_add(&bell, 1);
    futex(&bell, FUTEX_WAKE_PRIVATE, 1);
    return 1;
}

static int take_back(struct pool *p) { /* 1: the helper never took it */
    struct pool *was = p;
    return atomic_compare_exchange_strong(&posted, &was, NULL);
}
#else
static int start_helper(void) { return 0; }
static int offer(struct pool *p) { (void)p; return 0; }
static int take_back(struct pool *p) { (void)p; return 1; }
#endif

static void shared(part_fn fn, const void *args, uint64_t n, uint64_t piece) {
    int two = threads > 1 && piece && piece < n && (alone == 0 || (alone--, 0)) &&
              a_cpu_free() && start_helper();
    struct pool *p = two ? malloc(sizeof *p) : NULL;
    if (!p) {
        fn(args, 0, n); /* one thread: small work, one CPU, or no memory */
        return;
    }
    atomic_init(&p->next, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->helped, 0);
    atomic_init(&p->refs, 2);
    p->fn = fn, p->args = args, p->n = n, p->piece = piece;
    int offered = offer(p);
    work(p, 0);
    if (!offered || take_back(p)) release(p); /* the helper's reference: it never saw it */
    uint64_t pieces = (n + piece - 1) / piece;
    while (atomic_load(&p->done) < pieces) sched_yield(); /* the helper's last piece */
    if (offered && atomic_load(&p->helped) == 0 && threads == 2) alone = 16; /* no CPU */
    release(p);
}

struct rows_job { const uint8_t *data; uint64_t n, rb; const v32 *key; uint8_t *out; };

static void rows_part(const void *args, uint64_t from, uint64_t to) {
    const struct rows_job *j = args;
    const uint8_t *data = j->data;
    uint64_t n = j->n, rb = j->rb;
    uint8_t *out = j->out;
    v32 key[8];
    memcpy(key, j->key, sizeof key);
    uint64_t chunks = rb ? (rb + 1023) / 1024 : 1;
    for (uint64_t i = from; i < to; i += LANES) {
        const uint8_t *rows[LANES];
        for (int l = 0; l < LANES; l++)
            rows[l] = data + rb * (i + l < n ? i + l : n - 1); /* short: the last row again */
        v32 cv[8];
        subtree(cv, rows, rb, 0, chunks, key, 1);
        for (int l = 0; l < LANES && i + l < n; l++)
            for (int w = 0; w < 4; w++) {
                uint32_t v = cv[w][l];
                memcpy(out + 16 * (i + l) + 4 * w, &v, 4);
            }
    }
}

/* out[16 * i ...]: the first 16 bytes of BLAKE3-keyed(key, row i), rows of rb bytes */
void somatize_rows(const uint8_t *data, uint64_t n, uint64_t rb, const uint8_t key32[32],
                   uint8_t *out) {
    v32 key[8];
    uint32_t kw[8];
    memcpy(kw, key32, 32);
    for (int i = 0; i < 8; i++) key[i] = (v32){} + kw[i];
    struct rows_job j = {data, n, rb, key, out};
    /* pieces of two groups of LANES rows */
    shared(rows_part, &j, n, n * rb >= helped_bytes ? 2 * LANES : 0);
}

struct gather_job { uint8_t *dst; const uint8_t *src; const int64_t *rows; uint64_t rb; };

static void gather_part(const void *args, uint64_t from, uint64_t to) {
    const struct gather_job *j = args;
    for (uint64_t i = from; i < to; i++)
        memcpy(j->dst + j->rb * i, j->src + j->rb * (uint64_t)j->rows[i], j->rb);
}

/* dst row i <- src row rows[i] (rows of rb bytes); returns 0, or 1 (nothing copied) if a
 * row is outside src's src_rows */
int somatize_gather(uint8_t *dst, const uint8_t *src, uint64_t src_rows, const int64_t *rows,
                    uint64_t n, uint64_t rb) {
    for (uint64_t i = 0; i < n; i++)
        if (rows[i] < 0 || (uint64_t)rows[i] >= src_rows) return 1;
    struct gather_job j = {dst, src, rows, rb};
    shared(gather_part, &j, n, n * rb >= helped_bytes ? 32 : 0);
    return 0;
}

/* A table of items served before: 16-byte keys (BLAKE3 output: their first 8 bytes are
 * the hash) -> rows, open addressing, slots of 24 bytes (the key, the row + 1, 0 if the
 * slot is empty), mask + 1 slots (a power of two, at most 3/4 full: _served.py). */
static inline uint64_t first8(const uint8_t *k) { uint64_t h; memcpy(&h, k, 8); return h; }

void somatize_table_put(uint8_t *table, uint64_t mask, const uint8_t *keys, const int64_t *rows,
                        uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *k = keys + 16 * i;
        for (uint64_t s = first8(k) & mask;; s = (s + 1) & mask) {
            uint8_t *slot = table + 24 * s;
            int64_t v;
            memcpy(&v, slot + 16, 8);
            if (v == 0 || memcmp(slot, k, 16) == 0) {
                int64_t r = rows[i] + 1;
                memcpy(slot, k, 16);
                memcpy(slot + 16, &r, 8);
                break;
            }
        }
    }
}

/* out[i]: the row of key i; returns n, or the index of the first key not there */
uint64_t somatize_table_get(const uint8_t *table, uint64_t mask, const uint8_t *keys,
                            uint64_t n, int64_t *out) {
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *k = keys + 16 * i;
        for (uint64_t s = first8(k) & mask;; s = (s + 1) & mask) {
            const uint8_t *slot = table + 24 * s;
            int64_t v;
            memcpy(&v, slot + 16, 8);
            if (v == 0) return i;
            if (memcmp(slot, k, 16) == 0) { out[i] = v - 1; break; }
        }
    }
    return n;
}

static inline int64_t found(const uint8_t *table, uint64_t mask, const uint8_t *k) {
    for (uint64_t s = first8(k) & mask;; s = (s + 1) & mask) {
        const uint8_t *slot = table + 24 * s;
        int64_t v;
        memcpy(&v, slot + 16, 8);
        if (v == 0 || memcmp(slot, k, 16) == 0) return v - 1; /* -1: not there */
    }
}

struct serve_job {
    struct rows_job rows;
    const uint8_t *table, *arena;
    uint64_t mask, arena_rows, orb;
    uint8_t *dst;
    _Atomic uint64_t missing;
};

static void serve_part(const void *args, uint64_t from, uint64_t to) {
    struct serve_job *j = (struct serve_job *)args;
    rows_part(&j->rows, from, to);
    uint64_t miss = 0;
    for (uint64_t i = from; i < to; i++) {
        int64_t r = j->table ? found(j->table, j->mask, j->rows.out + 16 * i) : -1;
        if (r < 0 || (uint64_t)r >= j->arena_rows) miss++;
        else memcpy(j->dst + j->orb * i, j->arena + j->orb * (uint64_t)r, j->orb);
    }
    if (miss) atomic_fetch_add(&j->missing, miss);
}

/* A batch served in one call: keys[16 i ..] as somatize_rows gives them, and where every
 * key is in the table (table may be NULL: none is), dst row i <- arena row of key i (rows
 * of orb bytes). Returns how many rows were found; dst is whole only when that is n. */
uint64_t somatize_serve(const uint8_t *data, uint64_t n, uint64_t rb, const uint8_t key32[32],
                        uint8_t *keys, const uint8_t *table, uint64_t mask,
                        const uint8_t *arena, uint64_t arena_rows, uint8_t *dst, uint64_t orb) {
    v32 key[8];
    uint32_t kw[8];
    memcpy(kw, key32, 32);
    for (int i = 0; i < 8; i++) key[i] = (v32){} + kw[i];
    struct serve_job j = {{data, n, rb, key, keys}, table, arena, mask, arena_rows, orb, dst, 0};
    shared(serve_part, &j, n, n * (rb + orb) >= helped_bytes ? 2 * LANES : 0);
    return n - atomic_load(&j.missing);
}
