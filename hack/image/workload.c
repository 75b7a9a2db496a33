/* The dev cluster's workload container (image gpupool-workload:<version>, built by hack/image/build.py
 * with gcc -static -Os): prints its environment to stdout, sorted, one VAR=value per line (what the
 * device plugin's Allocate put there: NVIDIA_VISIBLE_DEVICES, ...), flushes, then sleeps until SIGTERM
 * or SIGINT, and exits 0. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;

static volatile sig_atomic_t stop;

static void on_signal(int signo) {
    (void)signo;
    stop = 1;
}

static int compare(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(void) {
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    size_t n = 0;
    while (environ[n] != NULL) {
        n++;
    }
    char **vars = malloc((n + 1) * sizeof *vars);
    if (vars == NULL) {
        return 1;
    }
    memcpy(vars, environ, n * sizeof *vars);
    qsort(vars, n, sizeof *vars, compare);
    for (size_t i = 0; i < n; i++) {
        puts(vars[i]);
    }
    fflush(stdout);
    /* block the signals, then wait for one atomically: no wake-up is lost between the check and the sleep */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &old);
    while (!stop) {
        sigsuspend(&old);
    }
    return 0;
}
