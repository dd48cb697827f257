"""Make the small sample inputs in this folder (run from anywhere; output is committed).

images/<class>/<name>.{jpg,png}: 36 small photo-like scenes in three classes
(beach, forest, night), made of smooth gradients, low-frequency texture and
soft shapes, JPEG-encoded. Awkward cases the decoders must handle are included:
a grayscale JPEG, a palette PNG with transparency, a JPEG with EXIF
orientation 6 (pixels stored rotated), a 16-bit grayscale PNG and an RGBA PNG.

video/*.avi, *.mp4: short clips of moving shapes (MJPG and MPEG-4), one shorter
than a clip so recipes must drop or pad it.
dicom/chest_*/IM*: synthetic chest CT phantoms (int16, slope 1, intercept
-1024; body ~ +40 HU, two lungs ~ -800 HU, a spine ~ +700 HU), file names
without extension; chest_b has uneven slice gaps (two slices left out) and its
files are written in shuffled order of InstanceNumber.
flow/<name>_img1.png, _img2.png, _flow.flo: textured pairs where img1 is img2
warped by a smooth known flow (Middlebury convention: img1(x) ~ img2(x + flow)),
one with an unknown-flow (1e10) region.
audio/*.wav|flac|ogg: tones and chirps at 16/22.05/44.1 kHz, mono and stereo.
segmentation/scene_NN.jpg, scene_NN_mask.png: 8 scenes and their label maps
(8-bit grey class ids 0 sky, 1 land, 2 water, 7 sun, 9 rock: not contiguous).
native/<class>/<name>_<h>x<w>.jpg: 9 scenes at 9 different sizes.
coco/images/*.png, coco/annotations/instances.json: a COCO-style detection set (see make_coco).
"""
from __future__ import annotations

import io
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    import cv2

    small = rng.random((cells, cells)).astype(np.float32)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


def scene(rng: np.random.Generator, cls: str, h: int = 96, w: int = 128) -> np.ndarray:
    import cv2

    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    palettes = {
        "beach": ([0.35, 0.6, 0.95], [0.95, 0.85, 0.6], [0.1, 0.35, 0.6]),
        "forest": ([0.6, 0.75, 0.85], [0.1, 0.35, 0.12], [0.25, 0.5, 0.2]),
        "night": ([0.02, 0.03, 0.12], [0.05, 0.05, 0.08], [0.2, 0.2, 0.35]),
    }
    sky, ground, accent = (np.array(c, np.float32) for c in palettes[cls])
    jitter = rng.normal(0, 0.05, 3).astype(np.float32)
    horizon = 0.35 + 0.3 * rng.random()
    ridge = horizon + 0.12 * (smooth_noise(rng, 1, w, 6)[0] - 0.5)
    yy = np.broadcast_to(y[:, :, 0], (h, w))
    land = (yy > ridge[None, :]).astype(np.float32)
    land = cv2.GaussianBlur(land, (0, 0), 1.2)[..., None]
    tex = smooth_noise(rng, h, w, 12)[..., None]
    img = (1 - land) * (sky + jitter + 0.25 * (1 - y)) + land * (ground + jitter + 0.25 * (tex - 0.5))
    for _ in range(rng.integers(2, 5)):  # soft blobs: sun, trees, rocks, stars
        cy, cx = rng.random() * h, rng.random() * w
        r = (0.04 + 0.12 * rng.random()) * w
        yy2, xx2 = np.mgrid[0:h, 0:w]
        blob = np.exp(-(((yy2 - cy) ** 2 + (xx2 - cx) ** 2) / (2 * r * r)))[..., None].astype(np.float32)
        img = img * (1 - 0.8 * blob) + 0.8 * blob * (accent + 0.3 * rng.random(3).astype(np.float32))
    img += rng.normal(0, 0.015, img.shape).astype(np.float32)  # sensor noise
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def save_jpeg(arr: np.ndarray, path: str, exif=None, quality: int = 88) -> None:
    from PIL import Image

    img = Image.fromarray(arr)
    kw = {"quality": quality}
    if exif is not None:
        kw["exif"] = exif
    img.save(path, "JPEG", **kw)


def make_images(root: str) -> None:
    from PIL import Image

    rng = np.random.default_rng(20261121)
    for cls in ("beach", "forest", "night"):
        d = os.path.join(root, "images", cls)
        os.makedirs(d, exist_ok=True)
        for i in range(12):
            arr = scene(rng, cls)
            name = f"{cls}_{i:02d}"
            if cls == "beach" and i == 0:
                # EXIF orientation 6: the camera stored the pixels rotated; viewers turn it 90 deg clockwise
                stored = np.ascontiguousarray(np.rot90(arr, 1))
                exif = Image.Exif()
                exif[0x0112] = 6
                save_jpeg(stored, os.path.join(d, name + "_exif6.jpg"), exif=exif)
            elif cls == "forest" and i == 0:
                Image.fromarray(arr).convert("L").save(os.path.join(d, name + "_gray.jpg"), quality=88)
            elif cls == "forest" and i == 1:
                p = Image.fromarray(arr).quantize(colors=32, method=Image.Quantize.MEDIANCUT)
                p.info["transparency"] = 0
                p.save(os.path.join(d, name + "_palette.png"), transparency=0)
            elif cls == "night" and i == 0:
                g16 = (arr.astype(np.uint16).mean(axis=-1) * 257).astype(np.uint16)
                Image.fromarray(g16).save(os.path.join(d, name + "_gray16.png"))
            elif cls == "night" and i == 1:
                rgba = np.concatenate([arr, np.full(arr.shape[:2] + (1,), 200, np.uint8)], axis=-1)
                Image.fromarray(rgba).save(os.path.join(d, name + "_rgba.png"))
            else:
                save_jpeg(arr, os.path.join(d, name + ".jpg"))


def make_video(root: str) -> None:
    import cv2

    rng = np.random.default_rng(7)
    d = os.path.join(root, "video")
    os.makedirs(d, exist_ok=True)
    for name, n, fourcc, ext in (("squares", 40, "MJPG", "avi"), ("balls", 30, "mp4v", "mp4"),
                                 ("tiny", 6, "MJPG", "avi")):
        h, w = 48, 64
        bg = (smooth_noise(rng, h, w, 4)[..., None] * np.array([90, 120, 60], np.float32)).astype(np.uint8)
        wr = cv2.VideoWriter(os.path.join(d, f"{name}.{ext}"), cv2.VideoWriter_fourcc(*fourcc), 25, (w, h))
        x0, y0 = rng.integers(5, 20, 2)
        vx, vy = rng.integers(1, 3, 2)
        for t in range(n):
            fr = bg.copy()
            cx, cy = int(x0 + vx * t) % w, int(y0 + vy * t) % h
            if name == "balls":
                cv2.circle(fr, (cx, cy), 7, (230, 60, 40), -1)
            else:
                cv2.rectangle(fr, (cx - 6, cy - 6), (cx + 6, cy + 6), (40, 200, 230), -1)
            cv2.putText(fr, str(t), (2, h - 4), cv2.FONT_HERSHEY_PLAIN, 0.8, (255, 255, 255), 1)
            wr.write(np.ascontiguousarray(fr[..., ::-1]))  # OpenCV wants BGR
        wr.release()


def chest_phantom(n: int = 64, z: np.ndarray | None = None) -> np.ndarray:
    """HU slices of a chest phantom at slice positions ``z`` in [0, 1] (lungs taper at both ends)."""
    yy, xx = (np.mgrid[0:n, 0:n] + 0.5) / n * 2 - 1
    out = []
    for zf in z:
        s = np.full((n, n), -1000.0, np.float32)                   # air
        s[(xx / 0.85) ** 2 + (yy / 0.62) ** 2 <= 1] = 40              # soft tissue
        taper = max(0.0, 1 - ((zf - 0.5) / 0.55) ** 2) ** 0.5
        for cx in (-0.4, 0.4):
            lung = ((xx - cx) / (0.28 * taper + 1e-6)) ** 2 + ((yy + 0.02) / (0.42 * taper + 1e-6)) ** 2 <= 1
            s[lung] = -800
            vessel = ((xx - cx * 0.9) ** 2 + (yy + 0.1) ** 2) <= 0.004   # a vessel inside each lung
            s[lung & vessel] = 30
        s[(xx ** 2 + (yy - 0.42) ** 2) <= 0.012] = 700                # spine
        s[(np.abs(xx) <= 0.06) & (np.abs(yy - 0.05) <= 0.12)] = 50     # mediastinum
        out.append(s)
    return np.stack(out)


def write_ct_slice(path: str, hu: np.ndarray, z: float, inst: int, series_uid: str, study_uid: str,
                   spacing: float, thickness: float) -> None:
    import pydicom
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = f"{series_uid}.{inst}"
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = pydicom.Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = CTImageStorage
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID = study_uid
    ds.SeriesInstanceUID = series_uid
    ds.Modality = "CT"
    ds.PatientName = "Phantom^Chest"
    ds.PatientID = "PHANTOM"
    ds.InstanceNumber = inst
    ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
    n = hu.shape[0]
    ds.ImagePositionPatient = [-n * spacing / 2, -n * spacing / 2, round(z, 4)]
    ds.PixelSpacing = [spacing, spacing]
    ds.SliceThickness = thickness
    ds.Rows, ds.Columns = hu.shape
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.BitsAllocated = 16
    ds.BitsStored = 16
    ds.HighBit = 15
    ds.PixelRepresentation = 1
    ds.RescaleSlope = 1
    ds.RescaleIntercept = -1024
    ds.PixelData = (np.rint(hu) + 1024).astype("<i2").tobytes()
    ds.save_as(path, enforce_file_format=True)


def make_dicom(root: str) -> None:
    rng = np.random.default_rng(3)
    base = os.path.join(root, "dicom")
    for name, nz, drop in (("chest_a", 24, ()), ("chest_b", 24, (9, 15))):
        d = os.path.join(base, name)
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
        zs = np.arange(nz) * 7.5
        hu = chest_phantom(64, zs / zs[-1])
        hu += rng.normal(0, 8, hu.shape).astype(np.float32)   # scanner noise
        uid = f"1.2.826.0.1.3680043.8.498.{1000 + nz}{len(drop)}"
        keep = [i for i in range(nz) if i not in drop]
        order = rng.permutation(len(keep))                    # file names do not follow position
        for k, j in enumerate(order):
            i = keep[j]
            write_ct_slice(os.path.join(d, f"IM{k:04d}"), hu[i], -200.0 + zs[i], int(nz - i), uid,
                           "1.2.826.0.1.3680043.8.498.1", 5.0, 7.5)


def make_flow(root: str) -> None:
    import cv2
    from PIL import Image

    sys.path.insert(0, os.path.dirname(HERE))
    from precompile.decoders.flo import write_flo

    rng = np.random.default_rng(11)
    d = os.path.join(root, "flow")
    os.makedirs(d, exist_ok=True)
    h, w = 48, 64
    for i in range(4):
        img2 = scene(rng, ("beach", "forest", "night", "beach")[i], h, w)
        tex = (smooth_noise(rng, h, w, 16)[..., None] * 120).astype(np.float32)
        img2 = np.clip(img2.astype(np.float32) * 0.6 + tex, 0, 255).astype(np.uint8)
        u = (smooth_noise(rng, h, w, 3) - 0.5) * 6 + rng.uniform(-2, 2)
        v = (smooth_noise(rng, h, w, 3) - 0.5) * 4 + rng.uniform(-1.5, 1.5)
        flow = np.stack([u, v], -1).astype(np.float32)
        gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
        img1 = cv2.remap(img2, gx + u, gy + v, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
        if i == 3:
            flow[30:40, 5:15] = np.nan                        # written as 1e10: unknown flow
        Image.fromarray(img1).save(os.path.join(d, f"pair{i}_img1.png"))
        Image.fromarray(img2).save(os.path.join(d, f"pair{i}_img2.png"))
        write_flo(os.path.join(d, f"pair{i}_flow.flo"), flow)


def make_audio(root: str) -> None:
    import soundfile as sf

    rng = np.random.default_rng(5)
    d = os.path.join(root, "audio")
    os.makedirs(d, exist_ok=True)
    for name, rate, secs, ch, fmt, sub in (("tone_16k", 16000, 1.5, 1, "WAV", "PCM_16"),
                                           ("chirp_22k_stereo", 22050, 1.2, 2, "FLAC", "PCM_16"),
                                           ("chord_44k", 44100, 1.0, 1, "OGG", "VORBIS"),
                                           ("click_8k", 8000, 0.3, 1, "WAV", "FLOAT")):
        t = np.arange(int(rate * secs)) / rate
        if name.startswith("chirp"):
            sig = [0.4 * np.sin(2 * np.pi * (200 + 900 * t) * t), 0.3 * np.sin(2 * np.pi * 330 * t)]
        elif name.startswith("chord"):
            sig = [sum(0.15 * np.sin(2 * np.pi * f * t) for f in (261.6, 329.6, 392.0))]
        elif name.startswith("click"):
            x = np.zeros_like(t)
            x[:: rate // 20] = 0.9
            sig = [x]
        else:
            sig = [0.5 * np.sin(2 * np.pi * 440 * t) * np.minimum(1, 10 * t)]
        x = np.stack(sig, -1) + rng.normal(0, 0.003, (len(t), ch))
        ext = {"WAV": "wav", "FLAC": "flac", "OGG": "ogg"}[fmt]
        sf.write(os.path.join(d, f"{name}.{ext}"), x.astype(np.float32), rate, format=fmt, subtype=sub)


#: segmentation/: the class ids of the label maps, and what each is
SEG_CLASSES = {0: "sky", 1: "land", 2: "water", 7: "sun", 9: "rock"}


def seg_scene(rng: np.random.Generator, h: int = 96, w: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """A photo-like scene and its label map (ids of SEG_CLASSES, not contiguous): sky over a ridge of
    land, a lake on the land, a sun in the sky and rocks on the land; the image is drawn from the map."""
    import cv2

    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    ridge = (0.35 + 0.2 * rng.random()) * h + 0.12 * h * (smooth_noise(rng, 1, w, 6)[0] - 0.5)
    lab = np.where(yy > ridge[None, :], 1, 0).astype(np.uint8)
    cy, cx = (0.65 + 0.25 * rng.random()) * h, rng.random() * w
    lake = ((yy - cy) / (0.12 * h)) ** 2 + ((xx - cx) / (0.3 * w)) ** 2 <= 1
    lab[lake & (lab == 1)] = 2
    sy, sx, sr = (0.08 + 0.15 * rng.random()) * h, (0.1 + 0.8 * rng.random()) * w, (0.05 + 0.04 * rng.random()) * w
    lab[((yy - sy) ** 2 + (xx - sx) ** 2 <= sr * sr) & (lab == 0)] = 7
    for _ in range(rng.integers(2, 5)):
        ry, rx, rr = (0.6 + 0.35 * rng.random()) * h, rng.random() * w, (0.03 + 0.04 * rng.random()) * w
        lab[((yy - ry) / 0.7) ** 2 + (xx - rx) ** 2 <= rr * rr] = 9
    colour = {0: (0.45, 0.65, 0.95), 1: (0.3, 0.55, 0.2), 2: (0.1, 0.3, 0.6), 7: (1.0, 0.9, 0.4), 9: (0.45, 0.42, 0.4)}
    img = np.zeros((h, w, 3), np.float32)
    for c, rgb in colour.items():
        img[lab == c] = rgb
    tex = smooth_noise(rng, h, w, 14)[..., None]
    img = cv2.GaussianBlur(img, (0, 0), 0.8) * (0.8 + 0.4 * tex) + 0.1 * (1 - yy[..., None] / h) * (lab == 0)[..., None]
    img += rng.normal(0, 0.015, img.shape).astype(np.float32)
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8), lab


def make_segmentation(root: str) -> None:
    """segmentation/scene_NN.jpg with scene_NN_mask.png: 8 scenes and their 8-bit label maps."""
    from PIL import Image

    rng = np.random.default_rng(20261125)
    d = os.path.join(root, "segmentation")
    os.makedirs(d, exist_ok=True)
    for i in range(8):
        img, lab = seg_scene(rng)
        save_jpeg(img, os.path.join(d, f"scene_{i:02d}.jpg"))
        Image.fromarray(lab, mode="L").save(os.path.join(d, f"scene_{i:02d}_mask.png"), optimize=True)


#: native/: the (height, width) of each scene, all different (a variable-shape build)
NATIVE_SIZES = [(96, 128), (72, 96), (120, 90), (64, 160), (100, 100), (80, 120), (128, 72), (90, 140), (60, 84)]


def make_native(root: str) -> None:
    """native/<class>/<name>.jpg: 9 scenes (three per class) at nine different sizes."""
    rng = np.random.default_rng(20261126)
    for k, (h, w) in enumerate(NATIVE_SIZES):
        cls = ("beach", "forest", "night")[k % 3]
        d = os.path.join(root, "native", cls)
        os.makedirs(d, exist_ok=True)
        save_jpeg(scene(rng, cls, h, w), os.path.join(d, f"{cls}_{k:02d}_{h}x{w}.jpg"))


FINDINGS = ["No Finding", "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema",
            "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion", "Pleural Other",
            "Fracture", "Support Devices"]


def make_chexpert(root: str) -> None:
    """A CheXpert-style table: train.csv (Path, Sex, Age, Frontal/Lateral, AP/PA, 14 findings holding
    1.0 / 0.0 / -1.0 / blank) beside small grayscale JPEGs under CheXpert-v1.0-small/train/patientN/studyM/."""
    import csv

    from PIL import Image

    rng = np.random.default_rng(18)
    d = os.path.join(root, "chexpert")
    rows = []
    for p in range(1, 7):
        for study in range(1, 1 + (p % 2) + 1):
            rel = f"CheXpert-v1.0-small/train/patient{p:05d}/study{study}/view1_frontal.jpg"
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            g = (smooth_noise(rng, 40, 32, 4) * 200 + 20).astype(np.uint8)
            Image.fromarray(g).save(os.path.join(d, rel), quality=85)
            cells = rng.choice(["1.0", "0.0", "-1.0", ""], size=len(FINDINGS), p=[0.2, 0.3, 0.1, 0.4])
            rows.append({"Path": rel, "Sex": ["Female", "Male"][p % 2], "Age": str(30 + 7 * p),
                         "Frontal/Lateral": "Frontal", "AP/PA": "AP", **dict(zip(FINDINGS, cells))})
    with open(os.path.join(d, "train.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def make_kinetics(root: str) -> None:
    """A Kinetics-style table: train.csv (label, youtube_id, time_start, time_end, split; labels with spaces
    and commas, quoted) and clips named <youtube_id>_<start:06d>_<end:06d>.mp4 (3 s at 10 fps, 32x32). The
    files hold the whole source video from 0 s; one row's file is missing, as in real downloads."""
    import csv

    import cv2

    d = os.path.join(root, "kinetics")
    os.makedirs(os.path.join(d, "videos"), exist_ok=True)
    rows = [("playing guitar", "aB3dE5fG7hI", 0, 2, "train"), ("dancing, ballet", "Zz9_yY8-xX7", 1, 3, "train"),
            ("playing guitar", "Qq1wW2eE3rR", 1, 2, "validate"), ("dancing, ballet", "Mm4nN5bB6vV", 0, 3, "train"),
            ("riding a bike", "Kk7jJ8hH9gG", 0, 2, "validate")]
    for i, (_, yid, a, b, _) in enumerate(rows):
        if i == len(rows) - 1:
            continue  # missing on disk: a per-input failure at build time
        wr = cv2.VideoWriter(os.path.join(d, "videos", f"{yid}_{a:06d}_{b:06d}.mp4"),
                             cv2.VideoWriter_fourcc(*"mp4v"), 10, (32, 32))
        for t in range(30):
            fr = np.full((32, 32, 3), 40 + 20 * i, np.uint8)
            cv2.circle(fr, (int(4 + t) % 32, 16), 4, (230, 60, 40), -1)
            wr.write(np.ascontiguousarray(fr[..., ::-1]))
        wr.release()
    with open(os.path.join(d, "train.csv"), "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_MINIMAL)
        w.writerow(["label", "youtube_id", "time_start", "time_end", "split"])
        w.writerows(rows)


def make_lung_ct(root: str) -> None:
    """A Kaggle-DSB-style labels table beside the DICOM series of make_dicom: id (the series folder), cancer."""
    d = os.path.join(root, "lung_ct")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "stage1_labels.csv"), "w") as f:
        f.write("id,cancer\nchest_a,0\nchest_b,1\n")


# -- coco/: a COCO-style detection set (images/*.png, annotations/instances.json) -----------------------

COCO_SIZE = (48, 64)                      # h, w of every image
COCO_KEYPOINTS = ["nose", "left_hand", "right_hand", "left_foot", "right_foot"]
#: image id -> [(annotation id, category id, [rectangles x0 y0 x1 y1: the object's polygons], crowd, rle)]
#: rle: None (polygons), "compressed" or "uncompressed" (the union of the rectangles as an RLE)
COCO_OBJECTS = {
    101: [(1, 3, [(8, 20, 40, 36), (16, 12, 32, 20)], 0, None), (2, 18, [(44, 28, 60, 44)], 0, None)],
    102: [(3, 1, [(20, 6, 32, 42)], 0, None), (4, 64, [(40, 30, 52, 38), (46, 38, 52, 46)], 0, None)],
    103: [(5, 1, [(4, 4, 28, 24)], 1, "compressed"), (6, 3, [(34, 26, 60, 40)], 0, None)],
    104: [],
    105: [(7, 18, [(20, 16, 36, 30)], 0, None), (8, 64, [(8, 8, 48, 40)], 0, None)],
    106: [(9, 18, [(30, 10, 62, 30)], 1, "uncompressed"), (10, 1, [(4, 8, 16, 44)], 0, None)],
    107: [(11, 1, [(6, 4, 18, 40)], 0, None), (12, 1, [(46, 6, 58, 44)], 0, None),
          (13, 3, [(22, 30, 30, 38), (30, 34, 40, 38), (34, 24, 42, 30)], 0, None)],
    108: [(14, 3, [(0, 30, 64, 48)], 0, None), (15, 18, [(10, 10, 30, 26)], 0, None)],
}


def _coco_keypoints(x0: int, y0: int, x1: int, y1: int) -> list[int]:
    """Five keypoints at pixel centres inside a person's box: x, y, v (v 0: x = y = 0, as COCO writes it)."""
    cx, my = (x0 + x1) // 2, (y0 + y1) // 2
    pts = [(cx, y0 + 1, 2), (x0, my, 2), (x1 - 1, my, 1), (x0 + 1, y1 - 1, 0), (x1 - 2, y1 - 1, 2)]
    return [v for x, y, vis in pts for v in ((x, y, vis) if vis else (0, 0, 0))]


def make_coco(root: str) -> None:
    """Eight 48x64 PNGs with flat rectangles (and an L shape, and a car in three parts) drawn where the
    polygons say, largest first so smaller objects lie on top, each annotation in its own colour (the
    non-standard key ``color`` records it for the tests); categories with ids 1, 3, 18, 64 listed out of
    order; two crowd regions (a compressed and an uncompressed RLE); an image with no annotations;
    keypoints on every person."""
    from PIL import Image
    from pycocotools import mask as cocomask

    d = os.path.join(root, "coco")
    os.makedirs(os.path.join(d, "images"), exist_ok=True)
    os.makedirs(os.path.join(d, "annotations"), exist_ok=True)
    h, w = COCO_SIZE
    images, anns = [], []
    for iid in sorted(COCO_OBJECTS, key=lambda i: (i * 37) % 11):   # the JSON lists them out of order
        img = np.full((h, w, 3), (24, 28, 32), dtype=np.uint8)
        objs = sorted(COCO_OBJECTS[iid], key=lambda o: -sum((r[2] - r[0]) * (r[3] - r[1]) for r in o[2]))
        for aid, cid, rects, crowd, rle in objs:
            color = [(aid * 53) % 180 + 60, (aid * 97) % 180 + 60, (aid * 31) % 180 + 60]
            m = np.zeros((h, w), dtype=np.uint8)
            for x0, y0, x1, y1 in rects:
                m[y0:y1, x0:x1] = 1
            img[m > 0] = color
            xs, ys = np.nonzero(m.any(0))[0], np.nonzero(m.any(1))[0]
            bbox = [int(xs[0]), int(ys[0]), int(xs[-1] + 1 - xs[0]), int(ys[-1] + 1 - ys[0])]
            if rle == "compressed":
                enc = cocomask.encode(np.asfortranarray(m))
                seg = {"counts": enc["counts"].decode("ascii"), "size": [h, w]}
            elif rle == "uncompressed":
                flat = m.T.reshape(-1)            # column-major, starting with a run of zeros
                edges = np.flatnonzero(np.diff(flat)) + 1
                runs = np.diff(np.concatenate([[0], edges, [flat.size]]))
                seg = {"counts": [0] * int(flat[0]) + [int(r) for r in runs], "size": [h, w]}
            else:
                seg = [[x0, y0, x1, y0, x1, y1, x0, y1] for x0, y0, x1, y1 in rects]
            a = {"id": aid, "image_id": iid, "category_id": cid, "bbox": bbox, "area": int(m.sum()),
                 "iscrowd": crowd, "segmentation": seg, "color": color}
            if cid == 1 and not crowd:
                a["keypoints"] = _coco_keypoints(*rects[0])
                a["num_keypoints"] = sum(1 for v in a["keypoints"][2::3] if v)
            anns.append(a)
        name = f"{iid:012d}.png"
        Image.fromarray(img).save(os.path.join(d, "images", name), optimize=True)
        images.append({"id": iid, "file_name": name, "height": h, "width": w})
    anns.sort(key=lambda a: a["id"])
    cats = [{"id": 18, "name": "dog", "supercategory": "animal"},
            {"id": 1, "name": "person", "supercategory": "person", "keypoints": COCO_KEYPOINTS,
             "skeleton": [[1, 2], [1, 3], [2, 4], [3, 5]]},
            {"id": 64, "name": "potted plant", "supercategory": "furniture"},
            {"id": 3, "name": "car", "supercategory": "vehicle"}]
    with open(os.path.join(d, "annotations", "instances.json"), "w", encoding="utf-8") as f:
        json.dump({"info": {"description": "precompile sample COCO-style set"}, "images": images,
                   "annotations": anns, "categories": cats}, f, indent=1)
        f.write("\n")


MAKERS = {"images": make_images, "video": make_video, "dicom": make_dicom, "flow": make_flow,
          "audio": make_audio, "segmentation": make_segmentation, "native": make_native,
          "chexpert": make_chexpert, "kinetics": make_kinetics, "lung_ct": make_lung_ct, "coco": make_coco}


def main(argv: list[str]) -> None:
    kinds = argv or list(MAKERS)
    for k in kinds:
        MAKERS[k](HERE)
        print(f"made sample_data/{k}")


if __name__ == "__main__":
    main(sys.argv[1:])
