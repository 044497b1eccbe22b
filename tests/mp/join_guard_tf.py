"""Worker for tests/test_tf_compressor.py's join guard, at 7 ranks under horovodrun (the PyTorch
one: tests/mp/join_guard.py). Rank 0 joins after one traced tape step, the others take two: their
second step's joined branch would make a collective Horovod 0.28.1 has not cached, whose answer
writes past a buffer on its coordinator (the job crashed: free(): invalid next size); it is refused
on every stepping rank (an op error naming it), which then join too. Every rank prints
``RESULT <rank> <errors> <named>``."""
import tensorflow as tf
import horovod.tensorflow as hvd

import hvd_qsgd


def main():
    hvd.init()
    rank = hvd.rank()
    c = hvd_qsgd.QSGD(4, seed=3)
    v = tf.Variable(tf.ones([20000]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * x)
        g = hvd.DistributedGradientTape(tape, compression=c).gradient(loss, [v])[0]
        v.assign_sub(0.1 * g)
        return g
    raised = []
    for _ in range(1 if rank == 0 else 2):
        try:
            step(tf.fill([20000], float(rank + 1)))
        except tf.errors.OpError as e:
            raised.append(str(e))
    hvd.join()
    named = all("writes past a buffer on its coordinator" in m for m in raised)
    print(f"RESULT {rank} {len(raised)} {named}", flush=True)


if __name__ == "__main__":
    main()
