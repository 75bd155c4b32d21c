/* Decode rounds in C: the llama.cpp worker's steady state without Python between the steps.
 *
 * When every lane of a tick feeds back the one token it sampled last, a step is a llama_decode
 * of one token per lane and a sample per lane. In Python the code around that call costs about
 * 100 us a step (a SmolLM2 step on two cores is 7.5 ms): the forward pass has just pushed the
 * interpreter out of the CPU caches. Here the same loop costs the argmax.
 *
 * Nothing is linked against llama.cpp: the worker hands over the addresses of the functions it
 * already loaded through llama-cpp-python (sf_bind), and the batch is llama-cpp-python's own
 * llama_batch, whose layout native.py checks before it binds this module. The functions are
 * called through ctypes; the module's Python face exists only so that it installs and imports
 * like any other extension module. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

typedef struct {        /* llama.h's llama_batch */
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
} batch_t;

typedef int32_t (*decode_fn)(void *ctx, batch_t batch);
typedef float *(*logits_ith_fn)(void *ctx, int32_t i);
typedef int32_t (*sample_fn)(void *sampler, void *ctx, int32_t i);
typedef bool (*is_eog_fn)(const void *vocab, int32_t token);

static decode_fn llama_decode;
static logits_ith_fn llama_get_logits_ith;
static sample_fn llama_sampler_sample;
static is_eog_fn llama_vocab_is_eog;

/* The llama.cpp functions to call: llama_decode, llama_get_logits_ith, llama_sampler_sample,
 * llama_vocab_is_eog. */
void sf_bind(void *decode, void *logits_ith, void *sample, void *is_eog)
{
    llama_decode = (decode_fn)decode;
    llama_get_logits_ith = (logits_ith_fn)logits_ith;
    llama_sampler_sample = (sample_fn)sample;
    llama_vocab_is_eog = (is_eog_fn)is_eog;
}

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The first maximum, as llama.cpp's greedy sampler picks it. */
static int32_t argmax(const float *row, int32_t n)
{
    int32_t best = 0;
    float top = row[0];
    for (int32_t i = 1; i < n; i++) {
        if (row[i] > top) {
            top = row[i];
            best = i;
        }
    }
    return best;
}

/* Run decode rounds for n_lanes lanes, given in sequence order. Lane i is sequence slot[i]; it
 * feeds last[i] at position pos[i], samples with sampler[i] (NULL: greedy argmax) and may sample
 * room[i] more tokens; it ends at an end-of-generation token unless ignore_eos[i]. ended[i] is
 * set to 1 (end of generation) or 2 (room used up); an ended lane takes no further part.
 *
 * Before each round the flags are read ({stop, 0, yield}: either ends the call). With `quiet`
 * set, the call also ends after a round in which a lane ended. Round r's token for lane i goes
 * to out[r * n_lanes + i] (-1: not in that round), its lane count to round_lanes[r], its time
 * (the forward pass and the sampling) to round_seconds[r].
 *
 * Returns the number of rounds run, at most max_rounds. A llama_decode that returns non-zero
 * ends the call: its code goes to *rc and that round is not counted (llama.cpp kept none of it).
 * pos, last and room are left as the counted rounds left them. */
int32_t sf_decode_rounds(void *ctx, const void *vocab, batch_t *batch, int32_t n_lanes,
                         const int32_t *slot, int32_t *pos, int32_t *last, void *const *sampler,
                         int32_t *room, const uint8_t *ignore_eos, uint8_t *ended, int32_t n_vocab,
                         const volatile int8_t *flags, int32_t quiet, int32_t max_rounds,
                         int32_t *out, int32_t *round_lanes, double *round_seconds, int32_t *rc)
{
    int32_t rounds = 0;
    *rc = 0;
    while (rounds < max_rounds && !flags[0] && !flags[2]) {
        int32_t n = 0;
        for (int32_t i = 0; i < n_lanes; i++) {
            if (ended[i])
                continue;
            batch->token[n] = last[i];
            batch->pos[n] = pos[i];
            batch->n_seq_id[n] = 1;
            batch->seq_id[n][0] = slot[i];
            batch->logits[n] = 1;
            n++;
        }
        if (n == 0)
            break;
        batch->n_tokens = n;
        double t0 = seconds_now();
        int32_t code = llama_decode(ctx, *batch);
        if (code != 0) {
            *rc = code;
            break;
        }
        int32_t row = 0;
        bool lane_ended = false;
        int32_t *tokens = out + (size_t)rounds * n_lanes;
        for (int32_t i = 0; i < n_lanes; i++) {
            tokens[i] = -1;
            if (ended[i])
                continue;
            int32_t token = sampler[i] ? llama_sampler_sample(sampler[i], ctx, row)
                                       : argmax(llama_get_logits_ith(ctx, row), n_vocab);
            row++;
            tokens[i] = token;
            pos[i] += 1;
            last[i] = token;
            room[i] -= 1;
            if (!ignore_eos[i] && llama_vocab_is_eog(vocab, token)) {
                ended[i] = 1;
                lane_ended = true;
            } else if (room[i] <= 0) {
                ended[i] = 2;
                lane_ended = true;
            }
        }
        round_lanes[rounds] = n;
        round_seconds[rounds] = seconds_now() - t0;
        rounds++;
        if (quiet && lane_ended)
            break;
    }
    return rounds;
}

static struct PyModuleDef rounds_module = {
    PyModuleDef_HEAD_INIT, "_rounds",
    "Decode rounds in C for the llama.cpp worker (called through ctypes; see _rounds.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__rounds(void)
{
    return PyModule_Create(&rounds_module);
}
