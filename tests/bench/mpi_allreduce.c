/* mpi_allreduce.c - Open MPI's MPI_Allreduce between processes, the reference
 * tests/bench/cluster_bench.sh runs beside Loom's (compiled there with mpicc,
 * run with mpirun --mca btl tcp,self so it goes over loopback TCP as Loom does).
 *   mpirun -np N mpi_allreduce SIZES_BYTES_COMMA_SEPARATED REPS
 * For each size: a warm-up, then REPS in-place float SUM all-reduces, each
 * after a barrier and timed on rank 0; prints "SIZE_BYTES MEDIAN_SECONDS". */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (argc < 3) {
        if (rank == 0) fprintf(stderr, "usage: mpi_allreduce SIZES REPS\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int reps = atoi(argv[2]);
    double *t = malloc(sizeof *t * (size_t)reps);
    for (char *p = strtok(argv[1], ","); p; p = strtok(NULL, ",")) {
        long size = atol(p);
        int count = (int)(size / 4);
        float *buf = malloc((size_t)size);
        for (int i = 0; i < count; i++) buf[i] = 1.0f;
        for (int w = 0; w < (size >= (16 << 20) ? 1 : 3); w++)
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (int r = 0; r < reps; r++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            t[r] = MPI_Wtime() - t0;
        }
        qsort(t, (size_t)reps, sizeof *t, cmp);
        if (rank == 0) {
            printf("%ld %.9f\n", size, t[reps / 2]);
            fflush(stdout);
        }
        free(buf);
    }
    MPI_Finalize();
    return 0;
}
