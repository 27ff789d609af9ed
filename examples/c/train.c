/* examples/c/train.c -- run a btjit export from C, no Python: train a tensor program, or evaluate a
 * scalar one (trace_scalar). Build against an export dir DIR (what prog.export(DIR) / btjit export wrote):
 *
 *     cc -O2 -I DIR -o train examples/c/train.c DIR/libbtjit.so -Wl,-rpath,DIR
 *     ./train DIR [STEPS] [BATCHES]
 *
 * Tensor program: STEPS steps (default 100), each feeding one batch -- read from the file BATCHES (every
 * input's values in order, int32 or BTJIT_FLOAT, one batch after another) or, without it, random valid
 * values -- and printing "step i loss L", then "buffer NAME sum S" for each buffer. Scalar function: STEPS calls of btjit_scalar_many on one random
 * row (BurTorch's E1 loop), printing the row, the value and the gradients. Either way the last line, on
 * stderr, gives the seconds spent in the library's calls and in all.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "btjit_program.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static double uniform(unsigned long long *s) { *s = *s * 6364136223846793005ULL + 1442695040888963407ULL; return (double)(*s >> 11) / 9007199254740992.0; }

int main(int argc, char **argv)
{
    if (argc < 2) { fprintf(stderr, "usage: %s EXPORT_DIR [STEPS] [BATCHES]\n", argv[0]); return 2; }
    long steps = argc > 2 ? atol(argv[2]) : 100;
    unsigned long long seed = 1;
    double t0 = now(), busy = 0;                        /* busy: time inside the library's calls */
#ifdef BTJIT_TENSOR
    btjit_program p;
    const char *err = btjit_open(argv[1], &p);
    if (err) { fprintf(stderr, "%s\n", err); return 1; }
    FILE *batches = argc > 3 ? fopen(argv[3], "rb") : NULL;
    if (argc > 3 && !batches) { fprintf(stderr, "%s: cannot open\n", argv[3]); return 1; }
    for (long s = 0; s < steps; s++) {
        for (int64_t i = 0; i < btjit_n_inputs; i++) {
            const btjit_input *in = &btjit_inputs[i];
            int32_t *ints = p.ia + in->offset;
            BTJIT_FLOAT *floats = (BTJIT_FLOAT *)p.a + in->offset;
            size_t got = !batches ? (size_t)in->size : in->is_int ? fread(ints, 4, in->size, batches)
                                                                 : fread(floats, sizeof *floats, in->size, batches);
            if (got != (size_t)in->size) { fprintf(stderr, "%s: no batch for step %ld\n", argv[3], s); return 1; }
            for (int64_t j = 0; !batches && j < in->size; j++) {
                if (in->is_int) ints[j] = (int32_t)(uniform(&seed) * (in->bound ? in->bound : 2));
                else floats[j] = (BTJIT_FLOAT)(2 * uniform(&seed) - 1);
            }
        }
        double t = now();
        int rc = btjit_step(&p);
        busy += now() - t;
        if (rc) { fprintf(stderr, "step %ld: %s\n", s, rc == 1 ? "an index is out of range" : "a kernel failed"); return 1; }
        /* %.9g round-trips a float32, %.17g a float64: the loss as the library computed it, bit for bit */
        printf("step %ld loss %.*g\n", s, sizeof(BTJIT_FLOAT) == 8 ? 17 : 9, (double)((BTJIT_FLOAT *)p.a)[BTJIT_OUT_OFFSET]);
    }
    for (int64_t i = 0; i < btjit_n_buffers; i++) {      /* the buffers the steps updated (btjit.assign) */
        double sum = 0;
        for (int64_t j = 0; j < btjit_buffers[i].size; j++) sum += (double)((BTJIT_FLOAT *)p.a)[btjit_buffers[i].offset + j];
        printf("buffer %s sum %.17g\n", btjit_buffers[i].name, sum);
    }
    btjit_close(&p);
#else
    const char *cpu = btjit_check_cpu();
    if (cpu) { fprintf(stderr, "%s: built for a CPU with %s, which this one lacks\n", argv[1], cpu); return 1; }
    BTJIT_FLOAT x[BTJIT_N_INPUTS], v[BTJIT_N_OUTPUTS + BTJIT_N_INPUTS], *g = v + BTJIT_N_OUTPUTS;
    for (int i = 0; i < BTJIT_N_INPUTS; i++) x[i] = (BTJIT_FLOAT)(2 * uniform(&seed) - 1);
    for (long s = 0; s < steps; s++) {         /* f(x): the code f(...) runs in Python, else f.many's */
#if BTJIT_HAS_ONE
        btjit_scalar_one(x, v);
#else
        btjit_scalar_many(x, 1, v, g);
#endif
    }
    busy = now() - t0;
    for (int i = 0; i < BTJIT_N_INPUTS; i++) printf("x %d %.17g\n", i, (double)x[i]);
    printf("value %.17g\n", (double)v[0]);
    for (int i = 0; i < BTJIT_N_INPUTS; i++) printf("grad %d %.17g\n", i, (double)g[i]);
#endif
    fprintf(stderr, "%ld steps: %.6g s in btjit, %.6g s in all\n", steps, busy, now() - t0);
    return 0;
}
