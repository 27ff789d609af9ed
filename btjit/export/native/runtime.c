/* btjit/native/runtime.c -- the fixed part of every exported btjit library (btjit/export.py).
 *
 * Compiled together with the export's generated program.c (its kernel table and metadata, btjit_program.h)
 * and the kernels' object code (numba's cached machine code, unchanged). It holds:
 *   - btjit_run: the executor -- rows [start, stop) of a kernel tape, each an indirect call of
 *     btjit_table[row[0]](a, na, ia, nia, row) (a row split for the threads: once per part j, with
 *     row[cols - 2] = j); a nonzero return (a failed index check) stops the tape;
 *   - btjit_open / btjit_step / ...: a C host's way in (files of the export dir, checked);
 *   - numba_attempt_nocopy_reshape (from numba's _helperlib.c, BSD-2-Clause), which kernels call, and
 *     kernel_failed(), which the generated stand-ins of the Python C API and numba helpers call.
 * No Python, no numba at run time: libc, libm and (only if the tape calls BLAS) the recorded OpenBLAS.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "btjit_program.h"

static volatile int kernel_error = 0;    /* set by kernel_failed() */

#ifdef BTJIT_TENSOR
typedef int32_t (*btjit_entry)(void *, int64_t, int32_t *, int64_t, int64_t *);
extern const btjit_entry btjit_table[];
extern const int64_t btjit_n_table;

int btjit_run(void *a, int64_t na, int32_t *ia, int64_t nia, int64_t *tape, int64_t cols,
              int64_t start, int64_t stop)
{
    for (int64_t i = start; i < stop; i++) {
        int64_t *row = tape + i * cols;
        int64_t parts = row[cols - 1] > 1 ? row[cols - 1] : 1;   /* a row split for the threads: its parts in turn */
        int64_t part[cols];
        if (parts > 1)
            memcpy(part, row, sizeof part);
        for (int64_t j = 0; j < parts; j++) {
            part[cols - 2] = j;
            if (btjit_table[row[0]](a, na, ia, nia, parts > 1 ? part : row) != 0)
                return 1;
        }
        if (kernel_error) {
            kernel_error = 0;
            return 2;
        }
    }
    return 0;
}
#endif

/* ------------------------------------------------------------------ numba's reshape helper */
int numba_attempt_nocopy_reshape(int64_t nd, const int64_t *dims, const int64_t *strides, int64_t newnd,
                                 const int64_t *newdims, int64_t *newstrides, int64_t itemsize, int is_f_order)
{
    int oldnd = 0, oi, oj, ok, ni, nj, nk;
    int64_t olddims[32], oldstrides[32], np, op, last_stride;
    for (oi = 0; oi < nd; oi++)
        if (dims[oi] != 1) {
            olddims[oldnd] = dims[oi];
            oldstrides[oldnd] = strides[oi];
            oldnd++;
        }
    np = 1;
    for (ni = 0; ni < newnd; ni++) np *= newdims[ni];
    op = 1;
    for (oi = 0; oi < oldnd; oi++) op *= olddims[oi];
    if (np != op) return 0;
    if (np == 0) {
        for (ni = 0; ni < newnd; ni++) newstrides[ni] = itemsize;
        return 1;
    }
    oi = 0; oj = 1; ni = 0; nj = 1;
    while (ni < newnd && oi < oldnd) {
        np = newdims[ni];
        op = olddims[oi];
        while (np != op) {
            if (np < op) np *= newdims[nj++];
            else op *= olddims[oj++];
        }
        for (ok = oi; ok < oj - 1; ok++) {
            if (is_f_order) {
                if (oldstrides[ok + 1] != olddims[ok] * oldstrides[ok]) return 0;
            } else if (oldstrides[ok] != olddims[ok + 1] * oldstrides[ok + 1]) {
                return 0;
            }
        }
        if (is_f_order) {
            newstrides[ni] = oldstrides[oi];
            for (nk = ni + 1; nk < nj; nk++) newstrides[nk] = newstrides[nk - 1] * newdims[nk - 1];
        } else {
            newstrides[nj - 1] = oldstrides[oj - 1];
            for (nk = nj - 1; nk > ni; nk--) newstrides[nk - 1] = newstrides[nk] * newdims[nk];
        }
        ni = nj++;
        oi = oj++;
    }
    last_stride = ni >= 1 ? newstrides[ni - 1] : itemsize;
    if (is_f_order) last_stride *= newdims[ni - 1];
    for (nk = ni; nk < newnd; nk++) newstrides[nk] = last_stride;
    return 1;
}

/* What numba's code calls only on an error path (a kernel raising) or from its Python wrappers (never
 * called here): the Python C API, NRT, numba helpers. btjit/export.py generates a stand-in for each such
 * symbol the objects refer to (program.c); a call records the failure, which btjit_run reports. */
void kernel_failed(void)
{
    if (!kernel_error) fputs("btjit: a kernel raised an error\n", stderr);
    kernel_error = 1;
}

#ifdef BTJIT_TENSOR
/* ------------------------------------------------------------------ files (for a C host) */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n)
{
    crc = ~crc;
    while (n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

static char errbuf[512];

/* read dir/name, exactly nbytes, CRC-32 crc, into a 64-byte aligned buffer (or report why not) */
static void *read_file(const char *dir, const char *name, int64_t nbytes, uint32_t crc)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(errbuf, sizeof errbuf, "%s: cannot open", path); return NULL; }
    void *buf = aligned_alloc(64, (size_t)((nbytes + 64) / 64 * 64));
    size_t got = buf ? fread(buf, 1, (size_t)nbytes, f) : 0;
    int extra = fgetc(f) != EOF;
    fclose(f);
    if (!buf || got != (size_t)nbytes || extra) {
        snprintf(errbuf, sizeof errbuf, "%s: expected %lld bytes (truncated or wrong file)", path,
                 (long long)nbytes);
        free(buf);
        return NULL;
    }
    if (crc32_update(0, buf, (size_t)nbytes) != crc) {
        snprintf(errbuf, sizeof errbuf, "%s: checksum mismatch (corrupt file)", path);
        free(buf);
        return NULL;
    }
    return buf;
}

const char *btjit_open(const char *dir, btjit_program *p)
{
    const char *cpu = btjit_check_cpu();
    if (cpu) {
        snprintf(errbuf, sizeof errbuf, "%s: built for a CPU with %s, which this one lacks", dir, cpu);
        return errbuf;
    }
    memset(p, 0, sizeof *p);
    p->na = BTJIT_ARENA_FLOATS;
    p->nia = BTJIT_ARENA_INTS;
    p->rows = BTJIT_TAPE_ROWS;
    p->cols = BTJIT_TAPE_COLS;
    p->a = read_file(dir, "arena.bin", p->na * (int64_t)sizeof(BTJIT_FLOAT), BTJIT_ARENA_CRC);
    if (p->a) p->ia = read_file(dir, "iarena.bin", p->nia * 4, BTJIT_IARENA_CRC);
    if (p->ia) p->tape = read_file(dir, "tape.bin", p->rows * p->cols * 8, BTJIT_TAPE_CRC);
    if (!p->tape) {
        btjit_close(p);
        return errbuf;
    }
    btjit_init();
    return NULL;
}

int btjit_step(btjit_program *p) { return btjit_run(p->a, p->na, p->ia, p->nia, p->tape, p->cols, 0, p->rows); }

int btjit_run_to(btjit_program *p, int64_t stop) { return btjit_run(p->a, p->na, p->ia, p->nia, p->tape, p->cols, 0, stop); }

void btjit_close(btjit_program *p)
{
    free(p->a);
    free(p->ia);
    free(p->tape);
    memset(p, 0, sizeof *p);
}
#endif
